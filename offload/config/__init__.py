"""The config layer: the schema and its validation (`schema`), DeepSpeed and accelerate configs
translated (`deepspeed`), the README's key table (`docs`), parameter groups, the tiers by name
(`placement`) and sizes written as text (`sizes`). Imports only `offload.errors`.

`Config` and `load_config` are its face, loaded on first use: the translators import no part of
the schema."""

__all__ = ["Config", "load_config"]


def __getattr__(name):
    if name in __all__:
        from offload.config import schema

        return getattr(schema, name)
    raise AttributeError(f"module 'offload.config' has no attribute {name!r}")
