"""Side concerns of training, one file each: EMA weights, sample images."""
