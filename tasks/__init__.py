"""Background jobs on Celery + Redis (tokenizer training, SFT, pretraining, sweeps, neuron scans).

tasks.kinds: the registry of job kinds; tasks.lifecycle: the one job lifecycle (JobTask);
tasks.jobs: the job service (submit, list, show, cancel, wait); tasks/<kind>_job.py: one kind each.
"""
