"""The plan layer: where each unit's state goes and what it costs, as plain functions: the
optimizer tiers and slots (`optimizer_plan`), host budgets (`budgets`), the estimate of a model's
bytes per tier and the machine it runs on (`estimate`, `machine`), and the replay of a recorded
step under a machine's rates (`pipeline_model`)."""
