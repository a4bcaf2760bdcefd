"""Backends: the reference backend (torch + torch.distributed) and the nvFuser backend."""
