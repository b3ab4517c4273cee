"""gradcomp.optim: communication-efficient optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB) and
large-batch optimizers (LAMB, LARS) whose norms are right under data parallel."""
