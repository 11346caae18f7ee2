"""vLLM's trainer side: the weightsync backend's TrainerWeightTransferEngine."""
