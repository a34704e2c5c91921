"""A dataset defined where workers cannot import it, as in a notebook or a REPL.

Run: python - < examples/notebook_style.py

Read from stdin, this script has no file that forkserver workers could import, so torch's
DataLoader fails with "Can't get attribute 'Squares' on <module '__main__'>". steadyload
sends the class and the lambda by value (cloudpickle) and it just works. No
`if __name__ == "__main__":` is needed here: nothing re-runs this code in the workers.
"""

import torch

import steadyload as sl


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i * i


loader = sl.DataLoader(Squares(), batch_size=4, num_workers=2, collate_fn=lambda b: sum(b))
print("sums of squares per batch:", list(loader))
