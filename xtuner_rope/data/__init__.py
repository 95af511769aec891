"""What XTuner's dataloader runs: collate functions, the offline pack steps, the counted cuts."""
