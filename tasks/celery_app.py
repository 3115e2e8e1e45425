"""The Celery application. Broker = tasks.config.redis_url() (REDIS_URL, or the embedded server).

Job state lives in our own records (tasks.store), not in a Celery result backend, so results are
ignored. Messages are acknowledged late and rejected back to the queue if the worker process dies
(acks_late + task_reject_on_worker_lost); a job's own record decides whether a redelivered message
still has work to do, so a redelivery never runs a finished or reaped job twice.
"""

from __future__ import annotations

from celery import Celery
from celery.signals import worker_ready

from tasks import config

QUEUE = "lmscope"

app = Celery("lmscope", include=["tasks.tokenizer_job", "tasks.patching_job", "tasks.sft_job"])
app.conf.update(
    broker_url=config.redis_url(),
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": config.VISIBILITY_TIMEOUT_S},
    task_default_queue=QUEUE,
    task_ignore_result=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    worker_send_task_events=False,
    worker_hijack_root_logger=False,
    broker_pool_limit=4,
    timezone="UTC",
)


@worker_ready.connect
def _reap_on_start(**_):
    """A worker that starts after a crash marks the jobs its predecessor left 'running' as failed."""
    from tasks import store

    try:
        store.reap()
    except Exception:  # noqa: BLE001 - never keep a worker from starting
        pass


def publish(task, job_id: str) -> None:
    """Queue task(job_id) on the broker the environment names *now* (REDIS_URL, or the embedded
    server's data/redis.url), not the one seen when this module was imported: a long-lived web
    process can outlive the embedded server's port, and the tests run several brokers in turn."""
    with app.connection_for_write(config.redis_url()) as conn:
        task.apply_async(args=[job_id], task_id=job_id, connection=conn)


def revoke(job_id: str, terminate: bool) -> None:
    with app.connection_for_write(config.redis_url()) as conn:
        app.control.revoke(job_id, terminate=terminate, signal="SIGTERM", connection=conn)
