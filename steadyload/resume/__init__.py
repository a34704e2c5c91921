"""Resume: a loader's position captured (`checkpoint.Checkpoints.state_dict`), validated and
applied (`load_state_dict`) at any number of workers and ranks: the state's format
(checkpoint.py), each epoch's progress (progress.py), what decides its order
(epoch_order.py) and how it is dealt to ranks (shards.py)."""
