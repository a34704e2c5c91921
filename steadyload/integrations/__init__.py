"""Keep steadyload's loader inside training frameworks that build or wrap loaders.

One module per framework, each imported only by the user (this package imports nothing,
so steadyload installs and imports without any framework):

- `steadyload.integrations.accelerate`: accelerate's ``prepare`` and ``skip_first_batches``.
- `steadyload.integrations.transformers`: the transformers ``Trainer`` (and TRL's trainers).
- `steadyload.integrations.ray`: Ray Train's ``prepare_data_loader``.

Lightning needs no module: it rebuilds a loader from its public attributes or its recorded
arguments, and both keep steadyload's class and options (docs/design/integrations.md).
"""
