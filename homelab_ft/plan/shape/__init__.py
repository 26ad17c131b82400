"""What the model is, for the planner: its shape read once from the model transformers builds.

    shapes   `model_shape(config)`: the shape from the cache, else derived (the front door)
    types    what a shape holds: parameters per block kind, nn.Linear layers, experts, saved activations
    cache    derived shapes as JSON per (config, attention, transformers version): later plans need no torch
    derive   the shape read from the model transformers builds on the meta device (imports torch)
    saved    the activation bytes a block keeps for backward, measured under saved_tensors_hooks
    vision   an image-text model's vision side per image: image tokens, saved and working bytes, FLOPs

Only derive.py, saved.py and vision.py import torch, inside the functions the first plan of a config calls.
"""
