"""Background jobs on Celery + Redis (tokenizer training, SFT, sweeps)."""
