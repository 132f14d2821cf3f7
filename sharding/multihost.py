"""Multi-host runs: `jax.distributed` start-up, the global mesh, and liveness between processes.

Every host runs the same program (SPMD); process 0 is the leader. `initialize` connects the
processes, from explicit flags (`--coordinator-address HOST:PORT --num-processes N
--process-id I`) or from what JAX reads itself (`JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` /
`JAX_PROCESS_ID`, SLURM `srun`, Open MPI `mpirun`). On CPU the cross-process collectives go
through gloo. After it, `jax.devices()` lists every device of every process, and the mesh of
`sharding.mesh.make_mesh` spans all of them.

A collective with a dead peer can block forever (NCCL) and a dead coordinator leaves the others
waiting, so every process publishes a heartbeat counter in the coordination service's key-value
store and watches the others': the leader watches every follower, a follower watches the
leader. A peer silent for `heartbeat_timeout` seconds, or a store that no longer answers (the
leader, which hosts it, is gone), calls the registered failure callbacks (the server fails its
pending requests with the message) and then ends the process with `FAILURE_EXIT_CODE` after
`exit_grace` seconds, whatever the other threads are blocked in.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import jax

logger = logging.getLogger(__name__)

FAILURE_EXIT_CODE = 1
KEY_PREFIX = "jaxllm"
EXIT_KEY = f"{KEY_PREFIX}/exit"  # set by the leader when it exits: followers then exit too
STOP_KEY = f"{KEY_PREFIX}/stop"  # STOP_KEY/<process>: a follower was asked to stop; the leader drains
FAILED_KEY = f"{KEY_PREFIX}/failed"  # FAILED_KEY/<process>: why a follower could not go on
# Environment variables that make `jax.distributed.initialize()` find the cluster by itself.
_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")


@dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run (unset fields: found by JAX from the environment)."""

    coordinator_address: Optional[str] = None  # HOST:PORT of process 0's coordination service
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    local_device_ids: Optional[tuple[int, ...]] = None  # devices of this host the process uses
    heartbeat_interval: float = 1.0  # seconds between two heartbeats
    heartbeat_timeout: float = 10.0  # silence after which a peer counts as dead or hung
    exit_grace: float = 3.0  # after a peer failure: seconds to fail requests before the process exits
    initialization_timeout: int = 300  # seconds to wait for every process to connect
    shutdown_timeout: int = 30  # seconds the final barrier waits for the other processes

    def __post_init__(self) -> None:
        if self.coordinator_address is not None and ":" not in self.coordinator_address:
            raise ValueError(f"coordinator_address must be HOST:PORT, got {self.coordinator_address!r}")
        if self.num_processes is not None and (not isinstance(self.num_processes, int) or self.num_processes < 1):
            raise ValueError(f"num_processes must be a positive integer, got {self.num_processes!r}")
        if self.process_id is not None:
            if not isinstance(self.process_id, int) or self.process_id < 0:
                raise ValueError(f"process_id must be a non-negative integer, got {self.process_id!r}")
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise ValueError(f"process_id {self.process_id} is not below num_processes {self.num_processes}")
        if not 0 < self.heartbeat_interval < self.heartbeat_timeout:
            raise ValueError(
                f"heartbeat_interval ({self.heartbeat_interval}) must be positive and below "
                f"heartbeat_timeout ({self.heartbeat_timeout})"
            )

    @property
    def explicit(self) -> bool:
        return any(v is not None for v in (self.coordinator_address, self.num_processes, self.process_id))


def requested(config: Optional[DistributedConfig] = None, environ: Optional[dict] = None) -> bool:
    """Whether this process is part of a multi-process run: flags were given, or a launcher
    (JAX variables, `srun` with several tasks, `mpirun`) set up the environment."""
    if config is not None and config.explicit:
        return True
    env = os.environ if environ is None else environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return True
    return any(_int(env.get(name)) > 1 for name in _CLUSTER_ENV[1:])


def _int(value: Optional[str]) -> int:
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


_state_lock = threading.Lock()
_monitor: Optional[Heartbeats] = None


def initialize(config: DistributedConfig = DistributedConfig()) -> None:
    """Join the run (idempotent); on CPU first switch cross-process collectives to gloo."""
    global _monitor
    with _state_lock:
        if _monitor is not None:
            return
        # Cross-process collectives of the CPU backend (must precede its creation; GPUs use NCCL).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        options: dict[str, Any] = dict(
            initialization_timeout=config.initialization_timeout,
            shutdown_timeout_seconds=config.shutdown_timeout,
            # JAX's own detection ends the process abruptly; ours (shorter) fails requests first.
            heartbeat_timeout_seconds=max(100, int(config.heartbeat_timeout * 4)),
        )
        accepted = inspect.signature(jax.distributed.initialize).parameters  # the options vary across versions
        # JAX aborts the process (a C++ check failure and a stack dump) when the run does not
        # assemble in time: it gets a longer deadline, and ours ends the process with one line first.
        options["initialization_timeout"] = config.initialization_timeout + JAX_DEADLINE_MARGIN
        joined = threading.Event()
        watchdog = threading.Timer(config.initialization_timeout, _not_assembled, args=(config, joined))
        watchdog.daemon = True
        watchdog.start()
        try:
            jax.distributed.initialize(
                config.coordinator_address,
                config.num_processes,
                config.process_id,
                local_device_ids=list(config.local_device_ids) if config.local_device_ids else None,
                **{k: v for k, v in options.items() if k in accepted},
            )
        finally:
            joined.set()
            watchdog.cancel()
        logger.info(
            "jax.distributed: process %d of %d, %d local / %d global devices",
            jax.process_index(),
            jax.process_count(),
            jax.local_device_count(),
            jax.device_count(),
        )
        _monitor = Heartbeats(config)
        _monitor.start()
        if jax.process_index() == 0:
            atexit.register(end_run)
        else:
            _follow_the_leader_on_sigterm()


def _follow_the_leader_on_sigterm() -> None:
    """A follower cannot stop on its own: every step needs every process. Its SIGTERM (which
    JAX's preemption notifier would otherwise swallow) or SIGINT asks the leader to drain and
    end the run, and the follower exits with it; a second signal exits at once. When leader and
    followers are signalled together (a job being stopped), the leader's own drain ends
    the run and the followers leave through the normal exit path."""
    if threading.current_thread() is not threading.main_thread():
        return
    pid = jax.process_index()
    received: list[int] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        if received:
            print(f"jaxllm: process {pid}: second signal: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        received.append(signum)
        logger.warning(
            "process %d: %s: asking the leader to drain and end the run (a second signal exits now)",
            pid,
            signal.Signals(signum).name,
        )
        try:
            kv_client().key_value_set(f"{STOP_KEY}/{pid}", signal.Signals(signum).name, allow_overwrite=True)
        except Exception as exc:  # the coordination service is gone: nothing to drain
            print(f"jaxllm: process {pid}: the leader is unreachable ({exc}); exiting", file=sys.stderr, flush=True)
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, on_sigterm)  # Ctrl-C in a terminal reaches every process of the example


JAX_DEADLINE_MARGIN = 30
"""Seconds JAX's own start-up deadline lies beyond `initialization_timeout` (ours fires first)."""

NOT_ASSEMBLED_EXIT_CODE = 2


def _not_assembled(config: DistributedConfig, joined: threading.Event) -> None:
    """The run did not assemble within `initialization_timeout`: one line, then exit."""
    if joined.is_set():
        return
    who = "" if config.process_id is None else f"process {config.process_id}: "
    where = config.coordinator_address or "the coordinator from the environment"
    print(
        f"jaxllm: {who}the multi-host run did not assemble within {config.initialization_timeout} s: "
        f"not every one of the {config.num_processes or 'expected'} processes joined at {where}; start the "
        "missing ones with the same --coordinator-address and --num-processes (or raise --initialization-timeout)",
        file=sys.stderr,
        flush=True,
    )
    exit_now(NOT_ASSEMBLED_EXIT_CODE)


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def kv_client():
    """The coordination service's client of this process (key-value store, barriers)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


_agreements: dict[str, int] = {}


def agree_min(name: str, value: int, timeout: float = 300.0) -> int:
    """The smallest `value` any process passes. Every process makes the same sequence of calls
    (the n-th call of a `name` meets the n-th call of the others). Used where each host measures
    something (free memory) that all must then share."""
    if not is_multiprocess():
        return value
    client = kv_client()
    count = _agreements.get(name, 0)
    _agreements[name] = count + 1
    key = f"{KEY_PREFIX}/agree/{name}/{count}"
    client.key_value_set(f"{key}/{jax.process_index()}", str(int(value)))
    values = [int(client.blocking_key_value_get(f"{key}/{p}", int(timeout * 1000))) for p in range(jax.process_count())]
    return min(values)


def check_mesh_devices(devices) -> None:
    """A multi-process mesh must hold every device: a process without a device in the mesh
    could not take part in the step's collectives."""
    if not is_multiprocess():
        return
    used = {d.process_index for d in devices}
    idle = sorted(set(range(jax.process_count())) - used)
    if idle or len(devices) != jax.device_count():
        raise ValueError(
            f"a multi-process run must use every device: the parallel configuration uses "
            f"{len(devices)} of the {jax.device_count()} devices of {jax.process_count()} processes "
            f"(set tensor_parallel_size to {jax.device_count()})"
        )


# ----------------------------------------------------------------------------- liveness
_callbacks: list[Callable[[str], None]] = []


def on_peer_failure(callback: Callable[[str], None]) -> Callable[[], None]:
    """Call `callback(message)` when a peer process dies or hangs (before this process exits).
    Returns a function that removes it."""
    _callbacks.append(callback)
    return lambda: _callbacks.remove(callback) if callback in _callbacks else None


def report_failure(message: str, grace: Optional[float] = None) -> None:
    """Run the failure callbacks, then end this process after `grace` seconds (from a watchdog
    thread, so that a thread blocked in a collective cannot keep the process alive)."""
    grace = _monitor.config.exit_grace if grace is None and _monitor is not None else (grace or 0.0)
    logger.error("%s", message)
    print(f"jaxllm: {message}", file=sys.stderr, flush=True)
    timer = threading.Timer(grace, exit_now, args=(FAILURE_EXIT_CODE,))
    timer.daemon = True
    timer.start()
    for callback in list(_callbacks):
        try:
            callback(message)
        except Exception:
            logger.exception("peer-failure callback failed")


def leave_after_failure(message: str) -> int:
    """Follower: this process cannot go on (say, building the leader's engine failed here).
    Publish why (the leader stops at its next heartbeat round, naming this process), then
    leave the run the way the leader does: through JAX's shutdown barrier once the leader
    ends the run (a leader that failed the same way, e.g. on the same bad flags, exits at
    once), or at once if the leader goes away instead. Leaving before the leader reaches
    the barrier would make JAX abort the leader 30 s later with a stack dump. Returns the
    exit status."""
    logger.error("%s", message)
    print(f"jaxllm: {message}", file=sys.stderr, flush=True)
    config = _monitor.config if _monitor is not None else DistributedConfig()
    try:
        client = kv_client()
        client.key_value_set(f"{FAILED_KEY}/{jax.process_index()}", message, allow_overwrite=True)
        deadline = time.monotonic() + config.heartbeat_timeout + config.exit_grace + 5
        while time.monotonic() < deadline:
            try:
                if try_get(client, EXIT_KEY):
                    shutdown()
                    return FAILURE_EXIT_CODE
            except Exception:  # noqa: BLE001 - the coordination service is gone: so is the leader
                break
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the run is already torn down
        pass
    exit_now(FAILURE_EXIT_CODE)
    return FAILURE_EXIT_CODE


def exit_now(code: int) -> None:
    """End the process at once: after a peer failure the normal exit would wait in JAX's final
    barrier for a process that will never arrive."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


class Heartbeats(threading.Thread):
    """Publishes this process's heartbeat and watches the peers it depends on."""

    def __init__(self, config: DistributedConfig) -> None:
        super().__init__(name="jaxllm-heartbeat", daemon=True)
        self.config = config
        self.process_id = jax.process_index()
        peers = range(1, jax.process_count()) if self.process_id == 0 else [0]
        now = time.monotonic()
        self._seen: dict[int, tuple[str, float]] = {p: ("", now) for p in peers}
        self._stop = threading.Event()
        self._round_done = now  # when a round of heartbeats last completed (see `_watch_rounds`)
        self.failed: Optional[str] = None
        self._stop_requested = False  # leader: a follower's stop request was acted on
        self.leader_exiting = False  # follower: the leader ended the run (its heartbeats stop on purpose)

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        client = kv_client()
        beat = 0
        # A stopped (not dead) leader leaves its coordination service's calls hanging rather than
        # failing: a watchdog ends the process when a round of heartbeats stops completing.
        self._round_done = time.monotonic()
        threading.Thread(target=self._watch_rounds, name="jaxllm-heartbeat-watchdog", daemon=True).start()
        while not self._stop.wait(self.config.heartbeat_interval):
            beat += 1
            try:
                client.key_value_set(f"{KEY_PREFIX}/heartbeat/{self.process_id}", str(beat), allow_overwrite=True)
                message = self._check(client)
                self._round_done = time.monotonic()
            except Exception as exc:  # the coordination service is gone: so is the leader
                if self._stop.is_set():
                    return
                message = (
                    f"process {self.process_id}: lost the coordination service of process 0 "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                    "the leader died"
                )
            if message is not None and not self._stop.is_set():
                self.failed = message
                report_failure(message)
                return

    def _watch_rounds(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval):
            stalled = time.monotonic() - self._round_done
            if self.failed is None and stalled > self.config.heartbeat_timeout:
                message = (
                    f"process {self.process_id}: the coordination service of process 0 has not answered for "
                    f"{stalled:.0f} s: the leader hung or died; process {self.process_id} stops"
                )
                self.failed = message
                report_failure(message)
                return
            if self.failed is not None:
                return

    def _check(self, client) -> Optional[str]:
        now = time.monotonic()
        if self.process_id == 0:
            self._check_stop_requests(client)
            failed = self._failed_follower(client)
            if failed is not None:
                return failed
        elif self.leader_exiting or try_get(client, EXIT_KEY):
            # The leader is in JAX's shutdown barrier: silence is expected, and this follower
            # leaves as soon as its main loop sees `leader_exiting()`.
            self.leader_exiting = True
            return None
        for peer, (last, since) in self._seen.items():
            value = try_get(client, f"{KEY_PREFIX}/heartbeat/{peer}")
            if value != last:
                self._seen[peer] = (value, now)
            elif now - since > self.config.heartbeat_timeout:
                role = "follower" if peer else "leader"
                return (
                    f"process {peer} ({role}) sent no heartbeat for {now - since:.0f} s: it died or hung; "
                    f"process {self.process_id} stops"
                )
        return None

    def _failed_follower(self, client) -> Optional[str]:
        """Leader: the message of a follower that published why it cannot go on, if any."""
        for peer in self._seen:
            message = try_get(client, f"{FAILED_KEY}/{peer}")
            if message:
                return f"{message} (process {peer}, follower); process {self.process_id} stops"
        return None

    def _check_stop_requests(self, client) -> None:
        """Leader: a follower asked to stop (its SIGTERM): drain as if this process got the
        signal, once (the server's handler drains; elsewhere SIGTERM's usual effect)."""
        if self._stop_requested:
            return
        for peer in self._seen:
            name = try_get(client, f"{STOP_KEY}/{peer}")
            if name:
                self._stop_requested = True
                reason = f"process {peer} (follower) got {name}"
                logger.warning("%s: draining and ending the run", reason)
                if _stop_request_handler is not None:
                    _stop_request_handler(reason)
                else:
                    os.kill(os.getpid(), signal.SIGTERM)
                return


_stop_request_handler: Optional[Callable[[str], None]] = None


def try_get(client, key: str) -> str:
    """The value of `key` in the coordination store, "" while it is unset (other errors raise)."""
    try:
        return client.key_value_try_get(key)
    except Exception as exc:
        if "NOT_FOUND" not in str(exc) and "not found" not in str(exc).lower():
            raise
        return ""


def leader_exiting() -> bool:
    """Follower: whether the leader has ended the run (seen by the heartbeat thread within a
    round). A follower still working through calls that need no peer (the sampler, compiles
    of its own) drops them then: the leader waits for it in JAX's shutdown barrier."""
    monitor = _monitor
    return monitor is not None and monitor.leader_exiting


def on_stop_request(handler: Optional[Callable[[str], None]]) -> None:
    """Leader: what a follower's stop request does, called with a reason from the heartbeat
    thread (default: this process gets SIGTERM). A server passes its drain, so that a job
    signalling every process at once is not taken for a second signal ("stop now")."""
    global _stop_request_handler
    _stop_request_handler = handler


def end_run() -> None:
    """Leader: tell every follower to exit, then leave the run (registered at exit)."""
    if _monitor is None or not is_leader():
        return
    try:
        kv_client().key_value_set(EXIT_KEY, "1", allow_overwrite=True)
    except Exception:  # the run is already torn down
        return
    shutdown()


def shutdown() -> None:
    """Leave the run cleanly (every process must call it): stop the heartbeats, then JAX's barrier."""
    global _monitor
    with _state_lock:
        if _monitor is None:
            return
        _monitor.stop()
        _monitor = None
    jax.distributed.shutdown()
