"""Side concerns of training, one file each: EMA weights, sample images, the progress bar, the plan and summary a
run prints, throughput, checkpoints."""
