"""The Celery application. Broker = tasks.config.redis_url() (REDIS_URL, or the embedded server).

Job state lives in our own records (tasks.store), not in a Celery result backend, so results are
ignored. The tasks are the job kinds' (the modules in KIND_MODULES), each on tasks.lifecycle.JobTask.
Messages are acknowledged late and rejected back to the queue if the worker process dies
(acks_late + task_reject_on_worker_lost); a job's own record decides whether a redelivered message
still has work to do, so a redelivery never runs a finished or reaped job twice.

Logging: a worker's lines are lmscope's (model_core.core.settings.configure_logging: time, level,
logger, message), at the level of its --loglevel (tasks.worker.worker_argv: LMSCOPE_LOG_LEVEL). The
setup_logging receiver below is Celery's documented way to say so; with it, Celery leaves the root
logger and stdout/stderr alone.

Every worker's main process announces itself: from worker_ready until worker_shutdown a daemon
thread sets lmscope:worker:<node name> every config.WORKER_BEAT_EVERY_S with a time-to-live of
config.WORKER_BEAT_TTL_S (tasks.store.worker_beat); store.live_workers counts them (/healthz,
/metrics, and the warning on a job queued while none is alive).
"""

from __future__ import annotations

import logging
import threading

from celery import Celery
from celery.signals import setup_logging, worker_process_init, worker_ready, worker_shutdown

from tasks import config

log = logging.getLogger(__name__)

QUEUE = "lmscope"

# The job kinds: one module each, which registers its kind (tasks.kinds) and defines its task.
# The worker imports them (Celery's include) and so does the registry (tasks.kinds.load); the
# order is the CLI's. A new kind is a new module and a line here.
KIND_MODULES = ("tasks.tokenizer_job", "tasks.patching_job", "tasks.sft_job", "tasks.pretrain_job",
                "tasks.neuron_job", "tasks.preference_job", "tasks.head_search_job",
                "tasks.features_job", "tasks.diff_job", "tasks.crosscoder_job", "tasks.transcoders_job")

app = Celery("lmscope", include=list(KIND_MODULES))
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


@setup_logging.connect
def _configure_logging(loglevel=None, **_):
    """Celery calls this once per worker, in its main process (pool processes inherit it); loglevel
    is the number its --loglevel names (None or 0: LMSCOPE_LOG_LEVEL)."""
    from model_core.core.settings import configure_logging, current

    configure_logging(loglevel or current().log_level)


@worker_process_init.connect
def _yield_to_the_web_server(**_):
    """A pool process runs its jobs at nice JOB_NICE (the threads its jobs start inherit it): below
    the web server's engine and its requests (model_core.core.cpu_threads) on a machine they share."""
    from model_core.core.cpu_threads import JOB_NICE, lower_this_thread

    lower_this_thread(JOB_NICE)


@worker_ready.connect
def _reap_on_start(**_):
    """A worker that starts after a crash marks the jobs its predecessor left 'running' as failed."""
    from tasks import store

    try:
        store.reap()
    except Exception:  # noqa: BLE001 - never keep a worker from starting
        log.warning("could not mark the jobs of an earlier worker as failed", exc_info=True)


_BEAT: dict = {}  # this worker process's heartbeat thread: {"node", "stop", "thread"}


def _beat_client():
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(config.redis_url(), socket_timeout=2, socket_connect_timeout=2,
                                retry=Retry(NoBackoff(), 0))


@worker_ready.connect
def _start_heartbeat(sender=None, **_):
    """In the worker's main process (worker_ready is sent there, never in pool processes)."""
    from tasks import store

    node = getattr(sender, "hostname", None) or f"worker-{threading.get_ident()}"
    stop = threading.Event()

    def beat():
        r = _beat_client()
        while True:
            try:
                store.worker_beat(node, r)
            except Exception:  # noqa: BLE001 - Redis down: try again next time; the key expires meanwhile
                pass
            if stop.wait(config.WORKER_BEAT_EVERY_S):
                break
        try:
            store.worker_gone(node, r)
        except Exception:  # noqa: BLE001
            pass

    t = threading.Thread(target=beat, name="lmscope-worker-heartbeat", daemon=True)
    _BEAT.update(node=node, stop=stop, thread=t)
    t.start()


@worker_shutdown.connect
def _stop_heartbeat(**_):
    """Warm or cold shutdown: the worker stops counting as live at once (a killed one, after the TTL)."""
    if _BEAT.get("stop") is not None:
        _BEAT["stop"].set()
        _BEAT["thread"].join(3)


_CLIENTS: dict[str, Celery] = {}


def client() -> Celery:
    """The Celery app to send with, for the broker the environment names *now* (REDIS_URL, or the
    embedded server's data/redis.url). Not `app` alone: its broker was read at import, and a web
    process can outlive the embedded server's port (the tests also run several brokers in turn).
    Sending by task name needs no task code, so a small client app per broker URL is enough."""
    url = config.redis_url()
    if url == app.conf.broker_url:
        return app
    c = _CLIENTS.get(url)
    if c is None:
        c = Celery("lmscope-client", broker=url, set_as_current=False)
        c.conf.update({k: app.conf[k] for k in ("broker_transport_options", "task_default_queue",
                                                "task_serializer", "accept_content", "broker_pool_limit")})
        _CLIENTS[url] = c
    return c


def publish(task, job_id: str) -> None:
    """Queue task(job_id) (by name) on the current broker."""
    client().send_task(task.name, args=[job_id], task_id=job_id, queue=QUEUE)


def revoke(job_id: str, terminate: bool) -> None:
    """Best effort and never blocking the caller: the job's cancel flag already stops it between
    steps; the revoke only hurries a running task along (kombu retries a dead broker for minutes)."""
    def send():
        try:
            client().control.revoke(job_id, terminate=terminate, signal="SIGTERM")
        except Exception:  # noqa: BLE001
            pass

    threading.Thread(target=send, name=f"revoke-{job_id}", daemon=True).start()
