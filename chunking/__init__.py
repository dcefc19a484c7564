"""Text chunking: sentence splitting, PPL / MSP chunking, dynamic merging, overlap and baselines."""
