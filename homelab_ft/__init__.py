"""homelab-ft: fine-tune open-weight LLMs on your own GPUs."""

__version__ = "0.1.0"
