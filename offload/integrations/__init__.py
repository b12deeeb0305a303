"""Integrations of the offload engine with training frameworks.

`offload.integrations.hf`: the Hugging Face `Trainer` (`OffloadTrainer`).
`offload.integrations.accelerate`: an accelerate loop (`OffloadAccelerator`). Each integration is
imported on its own, so `import offload` never imports a framework.
"""
