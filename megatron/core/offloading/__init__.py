"""Moving tensors between the compute device and host memory: pinned buffers and copy streams
(`host_transfers`), and the saved activations of chosen layers (`activations`) or of chosen pieces of every layer
(`fine_grained`)."""
