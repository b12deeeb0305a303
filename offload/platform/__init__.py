"""The platform layer: the device and its streams (CUDA, the plain CPU, the checked stand-in),
collectives over torch.distributed, and the order in which ranks issue them."""
