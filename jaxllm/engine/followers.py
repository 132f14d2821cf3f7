"""A multi-host engine: process 0 plans, every process runs the same jitted steps.

The leader (process 0) is the only process with requests: it owns the queue, the scheduler and
the KV block manager, and the executor, the server and the benchmarks run there. Building an
`LLMEngine` on the leader opens a *session*: the engine's config is published in the
coordination service's key-value store and every follower builds the same runner from it
(`jaxllm.engine.builder.build_runner`, each loading only the weight shards of its own
devices; no scheduler, no KV block manager), and then mirrors the leader's runner: each call
that runs a device program (`execute(plan)`, and the warm-up's `forward` / `sample`) is sent to
the followers before the leader makes it, and
they make the same call, so every process launches the same programs in the same order and
their collectives meet. Compilations are announced too, so followers compile while the leader
does. Sampled tokens are read back on the leader only (they are replicated, so its own devices
hold them); followers never read anything back.

A device array passed to a mirrored call (the warm-up samples the logits of its last forward)
travels as a reference to the latest output of a mirrored method, which each follower holds.

The session ends with `close()` (the executor's shutdown); the run ends when the leader exits
(it sets an exit key that waiting followers see within a second).
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import jax

from jaxllm.engine.builder import build_runner
from jaxllm.engine.kv_host_copies import HostBlockCopier
from jaxllm.engine.plan_channel import ChannelClosed, decode, encode, make_channel
from jaxllm.engine.speculation import step_drafter_for
from jaxllm.engine.speculation_programs import MirroredSpeculation, SpeculationPrograms, relaxed_options
from jaxllm.engine.step_output import StepOutput
from jaxllm.models.resolve import resolve_model
from sharding import multihost

logger = logging.getLogger(__name__)

MIRRORED = ("execute", "forward", "sample")
COMPILES = ("compile_forward", "compile_sampler")
HOST_COPIES = ("open", "read", "start", "write", "warmup")  # the host KV tier's (HostBlockCopier)
SPECULATION = ("open", "verify", "draft")  # speculative decoding's programs (SpeculationPrograms)
SESSION_KEY = f"{multihost.KEY_PREFIX}/session"
EXIT_KEY = multihost.EXIT_KEY


class LeaderExited(Exception):
    """The leader ended the run (a clean exit: followers exit too)."""


@dataclass(frozen=True)
class LatestOutput:
    """Stands for leaf `leaf` of the latest output of mirrored method `method`."""

    method: str
    leaf: int


@dataclass
class ChannelStats:
    """What sending the runner calls to the followers cost the leader so far."""

    messages: int = 0
    bytes: int = 0
    encode_seconds: float = 0.0  # encoding the calls (plan_channel.encode)
    send_seconds: float = 0.0  # handing them to the channel (kv: one store write; collective: the broadcast)


def device_leaves(out: Any) -> list:
    """The device arrays of a runner call's result, which later calls may refer to."""
    if isinstance(out, StepOutput):
        return out.device_arrays()
    return jax.tree_util.tree_leaves(out)


class MirroredRunner:
    """The leader's runner for launching programs: sends every device-program call to the
    followers, then makes it on the wrapped runner. The engine reads state (parameters,
    compile counts) from the wrapped runner itself (`runner`)."""

    def __init__(self, runner: Any, channel: Any) -> None:
        self._runner = runner
        self._channel = channel
        self._latest: dict[str, list] = {}
        self.channel_stats = ChannelStats()
        self._closed = False
        self._send_lock = threading.Lock()  # close() may come from another thread than the steps
        if hasattr(channel, "wait_for"):
            channel.wait_for = lambda: [leaf for leaves in list(self._latest.values()) for leaf in leaves]

    @property
    def runner(self) -> Any:
        return self._runner

    def _send(self, message: tuple) -> None:
        started = time.perf_counter()
        payload = encode(message)
        encoded = time.perf_counter()
        with self._send_lock:
            self._channel.send(payload)
        stats = self.channel_stats
        stats.encode_seconds += encoded - started
        stats.send_seconds += time.perf_counter() - encoded
        stats.messages += 1
        stats.bytes += len(payload)

    def _reference(self, arg: Any) -> Any:
        if not isinstance(arg, jax.Array):
            return arg
        for method, leaves in self._latest.items():
            for i, leaf in enumerate(leaves):
                if leaf is arg:
                    return LatestOutput(method, i)
        raise ValueError(
            "a device array passed to a mirrored runner call must be the latest output of one of "
            f"{MIRRORED}: the followers hold no other"
        )

    def _mirror(self, method: str, *args: Any) -> Any:
        if self._closed:
            raise RuntimeError("the multi-host session is closed")
        self._send(("call", method, tuple(self._reference(a) for a in args)))
        out = getattr(self._runner, method)(*args)
        self._latest[method] = device_leaves(out)
        return out

    def execute(self, plan):
        return self._mirror("execute", plan)

    def forward(self, batch, feed_index, prev_tokens):
        return self._mirror("forward", batch, feed_index, prev_tokens)

    def sample(self, logits, sampling):
        return self._mirror("sample", logits, sampling)

    # Compiling runs nothing, but followers compile the same programs meanwhile (in parallel, as the
    # warm-up does here) instead of one at a time when the first step needs each.
    # Followers decide their own forward variants: the fused argmax is off in multi-host runs.
    fused_argmax = False

    def compile_forward(self, batch, feed_index, context_index=None, *, wait: bool = True):
        args = (batch, feed_index) if context_index is None else (batch, feed_index, context_index)
        self._send(("compile", "compile_forward", args))
        return self._runner.compile_forward(*args, wait=wait)

    def compile_sampler(self, logits, sampling, *, wait: bool = True):
        self._send(("compile", "compile_sampler", (self._reference(logits), sampling)))
        return self._runner.compile_sampler(logits, sampling, wait=wait)

    # Programs the followers never run (logits outputs, beam search and LoRA are refused in
    # multi-host runs): the leader's own runner compiles them.
    def compile_batched_processors(self, logits):
        return self._runner.compile_batched_processors(logits)

    def compile_logits_programs(self, logits, row_buckets):
        return self._runner.compile_logits_programs(logits, row_buckets)

    def copy_blocks(self, pairs):
        return self._runner.copy_blocks(pairs)

    def mirror_speculation(self, speculation: Any) -> None:
        """Have the engine's `Speculation` verify and draft on every process: each follower
        opens its own programs (and drafter) and makes the leader's calls."""
        self._send(("spec", "open", ()))
        programs = SpeculationPrograms(self._runner, speculation.drafter, relaxed_options(speculation.config))
        speculation.use_programs(
            MirroredSpeculation(programs, lambda method, args: self._send(("spec", method, args)), self._reference)
        )

    def mirror_copier(self, copier: HostBlockCopier) -> MirroredHostCopier:
        """The host KV tier's copier of this leader: each follower opens its own (for its
        devices' shards) and makes the same copies."""
        self._send(("host", "open", (copier.rows, copier.num_blocks, copier.attention_dp)))
        return MirroredHostCopier(copier, lambda method, args: self._send(("host", method, args)))

    def close(self) -> None:
        """End the session: the followers drop their runner and wait for the next engine."""
        if not self._closed:
            self._closed = True
            self._send(("stop",))
        self._runner.close()


class MirroredHostCopier:
    """The leader's host KV tier copier in a multi-host run: every call that runs a device
    program or moves bytes is sent to the followers first, which make it on their own copier;
    landing reads and polling for arrival stay local (each process lands its own)."""

    def __init__(self, copier: HostBlockCopier, send: Any) -> None:
        self._copier, self._send = copier, send
        self.memory_kind = copier.memory_kind

    @property
    def reads_in_flight(self) -> int:
        return self._copier.reads_in_flight

    @property
    def host_bytes(self) -> int:
        return self._copier.host_bytes

    def reading(self, row: int) -> bool:
        return self._copier.reading(row)

    def land(self, wait: bool) -> None:
        self._copier.land(wait)

    def oldest_write_ready(self) -> bool:
        return self._copier.oldest_write_ready()

    def read(self, src: Any, ranks: Any, rows: list[int]) -> None:
        self._send("read", (src, ranks, rows))
        self._copier.read(src, ranks, rows)

    def start(self, rows: list[int], size: int) -> None:
        self._send("start", (rows, size))
        self._copier.start(rows, size)

    def write(self, dst: Any, ranks: Any) -> None:
        self._send("write", (dst, ranks))
        self._copier.write(dst, ranks)

    def warmup(self, max_blocks: int) -> None:
        self._send("warmup", (max_blocks,))
        self._copier.warmup(max_blocks)


_session_lock = threading.Lock()
_sessions_opened = 0


def open_session(config: Any) -> Optional[str]:
    """On the leader of a multi-process run: publish `config` for the followers to build the
    same engine; returns the session's channel prefix. None elsewhere (single process, or a
    follower building its copy of the leader's engine)."""
    global _sessions_opened
    if not multihost.is_multiprocess() or not multihost.is_leader():
        return None
    with _session_lock:
        session = _sessions_opened
        _sessions_opened += 1
    multihost.kv_client().key_value_set_bytes(f"{SESSION_KEY}/{session}", encode(("engine", config)))
    logger.info("multi-host session %d: %d follower process(es) build the engine", session, jax.process_count() - 1)
    return f"{SESSION_KEY}/{session}/messages"


def mirror(runner: Any, prefix: Optional[str], channel_kind: str) -> Any:
    """`runner` as the leader's mirrored runner when a session is open, else unchanged."""
    if prefix is None:
        return runner
    return MirroredRunner(runner, make_channel(channel_kind, prefix))


# ----------------------------------------------------------------------------- followers
def _exit_requested(client) -> Optional[str]:
    try:
        if client.key_value_try_get(EXIT_KEY):
            return "exit"
    except Exception as exc:
        if "NOT_FOUND" not in str(exc) and "not found" not in str(exc).lower():
            return f"the coordination service failed: {str(exc).splitlines()[0]}"
    return None


def _wait(client, key: str) -> Optional[bytes]:
    """The value of `key`, or None once the leader asks the followers to exit."""
    while True:
        try:
            return client.blocking_key_value_get_bytes(key, 1000)
        except Exception as exc:
            if "DEADLINE_EXCEEDED" not in str(exc) and "timed out" not in str(exc).lower():
                raise ChannelClosed(f"the coordination service failed: {str(exc).splitlines()[0]}") from exc
        reason = _exit_requested(client)
        if reason == "exit":
            return None
        if reason:
            raise ChannelClosed(reason)


def follow(runner: Any, channel: Any, client: Any = None, open_speculation: Any = None) -> int:
    """Make the leader's runner calls on `runner` until the session stops; returns the calls
    made. `open_speculation()`: this process's `SpeculationPrograms` (speculating engines)."""
    latest: dict[str, list] = {}
    calls = 0
    copier: Optional[HostBlockCopier] = None  # this process's half of the host KV tier
    speculation: Optional[SpeculationPrograms] = None

    def stop_reason() -> Optional[str]:
        reason = _exit_requested(client) if client is not None else None
        if reason == "exit":  # the leader exited without closing the engine first
            raise LeaderExited()
        return reason

    if hasattr(channel, "wait_for"):
        channel.wait_for = lambda: [leaf for leaves in list(latest.values()) for leaf in leaves]
    while True:
        message = decode(channel.recv(stop_reason))
        if message[0] == "stop":
            return calls
        kind, method, args = message
        if kind == "spec":
            if method not in SPECULATION or (method != "open" and speculation is None) or open_speculation is None:
                raise ValueError(f"unexpected speculative decoding call {method!r} from the leader")
            if method == "open":
                speculation = open_speculation()
            else:
                args = tuple(latest[a.method][a.leaf] if isinstance(a, LatestOutput) else a for a in args)
                getattr(speculation, method)(*args)
            continue
        if kind == "host":
            if method not in HOST_COPIES:
                raise ValueError(f"unknown host tier call {method!r} from the leader")
            if method == "open":
                copier = HostBlockCopier(runner, *args)
            elif copier is None:
                raise ValueError(f"host tier call {method!r} before the leader opened the tier")
            else:
                getattr(copier, method)(*args)
            continue
        if method not in (COMPILES if kind == "compile" else MIRRORED):
            raise ValueError(f"unknown runner call {method!r} from the leader")
        args = tuple(latest[a.method][a.leaf] if isinstance(a, LatestOutput) else a for a in args)
        if kind == "compile":
            # Queued on the runner's compile threads, as on the leader. A call that runs a
            # program waits for that program's compile alone (or compiles it at once if it has
            # not started), never for the whole queue: the leader is already waiting in the
            # program's first collective, which gives up after a while.
            getattr(runner, method)(*args, wait=False)
            continue
        if multihost.leader_exiting():  # calls the leader ran without this process (the sampler) are moot
            raise LeaderExited()
        out = getattr(runner, method)(*args)
        latest[method] = device_leaves(out)
        calls += 1


def follower_speculation(config: Any, runner: Any, num_blocks: int) -> SpeculationPrograms:
    """A follower's speculative decoding programs for the engine of `config`, on its `runner`."""
    spec = config.speculative_config
    drafter = step_drafter_for(spec, runner, num_blocks, config.kv_cache_config.tokens_per_block)
    return SpeculationPrograms(runner, drafter, relaxed_options(spec))


def check_same_model(expected: str, leader_model: str) -> None:
    """A worker started with a model of its own (`jaxllm worker --model`) follows only a leader
    serving that model: the same directory, or one with the same config.json (ValueError)."""
    mine, theirs = Path(expected), resolve_model(leader_model)
    if mine.resolve() == theirs.resolve():
        return
    try:
        same = json.loads((mine / "config.json").read_text()) == json.loads((theirs / "config.json").read_text())
    except (OSError, ValueError):
        same = False
    if not same:
        raise ValueError(
            f"this worker was started with --model {expected}, but the leader serves {leader_model}; "
            "start every process of the run with the same model"
        )


def run_follower(expected_model: Optional[str] = None) -> int:
    """A follower's whole life: build the runner of each engine the leader opens and mirror the
    leader's runner, until the leader exits. Returns the process exit code. `expected_model`:
    the model this process was started with, if any (a leader serving another is refused)."""
    if multihost.is_leader():
        raise ValueError("process 0 is the leader: it runs the engine, not a follower loop")
    client = multihost.kv_client()
    session = 0
    pid = jax.process_index()
    try:
        while True:
            payload = _wait(client, f"{SESSION_KEY}/{session}")
            if payload is None:
                break
            _, config = decode(payload)
            logger.info("process %d: building the engine of session %d (%s)", pid, session, config.model)
            try:
                if expected_model is not None:
                    check_same_model(expected_model, config.model)
                parts = build_runner(config)
                runner = parts.runner
            except Exception as exc:  # noqa: BLE001 - this process cannot follow: say why, leave the run cleanly
                return multihost.leave_after_failure(f"process {pid}: {type(exc).__name__}: {exc}; exiting")
            channel = make_channel(config.multihost_plan_channel, f"{SESSION_KEY}/{session}/messages")
            calls = follow(
                runner,
                channel,
                client,
                open_speculation=functools.partial(follower_speculation, config, parts.runner, parts.num_blocks),
            )
            logger.info("process %d: session %d ended after %d steps", pid, session, calls)
            runner.close()  # its compile threads
            del runner, parts
            gc.collect()
            session += 1
    except LeaderExited:
        pass
    except Exception as exc:  # the leader is gone (or its step failed here): no step can run any more
        reason = str(exc) if isinstance(exc, ChannelClosed) else f"{type(exc).__name__}: {exc}"
        multihost.report_failure(f"process {pid}: {reason}; exiting", grace=0.0)
        return multihost.FAILURE_EXIT_CODE
    logger.info("process %d: the leader exited", pid)
    multihost.shutdown()
    return 0
