"""Moving tensors between ranks: in-process and torch.distributed transports, process groups, launch, placement."""
