"""Engine: the schedule -> step -> sample loop over a paged KV cache."""
