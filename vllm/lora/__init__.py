"""LoRA adapters: requests name an adapter; the runner applies it to the linear layers it
targets, for many adapters in one batch (docs/architecture.md, "LoRA adapters")."""
