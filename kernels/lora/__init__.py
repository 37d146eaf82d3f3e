"""LoRA adapters: reading PEFT directories, device slots, the per-row delta."""
