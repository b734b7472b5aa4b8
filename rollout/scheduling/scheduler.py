"""The async scheduler: admits prompts, runs each prompt's group on one engine, hands it on.

Owns the data path between the prompt sources and where groups go:
  1) read the next prompt: from the fed sources (the learner's, one after another, lazily), or
     from a caller's `Submission` (each read on its own, alongside);
  2) for groups to train on, wait for the staleness budget (`staleness.max_lag`, see
     `staleness.Admission`); for the learner's, reserve a queue slot (a full queue stops admission);
  3) validate it against the model and its sampling values (a bad one becomes a failed group,
     which gives its admission slot back); a prompt from a list comes checked (`check_all`, when
     it was fed or submitted), so each prompt is checked once;
  4) wait for room for the whole group on the engine with the least work waiting and in flight
     (`Runner.acquire`, `router.route`: another engine takes it only rather than run below a full
     batch). Each engine holds its running batch plus `engines.queued_per_engine` more waiting in
     vLLM's queue, so a finished request's successor starts in the next step, not a round trip later.
     Groups admitted meanwhile wait in the `Lobby`, the largest `max_tokens` first, and reading goes
     on while admission allows: the long samples of a long-tailed set start first (LPT), as vLLM
     orders its own queue (`policies.vllm_adapter.frontend`);
  5) run the group's `n` samples on that engine, so they share its prefix cache (`Runner.run`:
     each sample's slot comes back as that sample ends, not when its group does; the unfinished
     ones move to another engine if that one dies); with `env` set each sample is an episode
     (`rollout.episodes.loop`) whose turns stay on one engine while it lives;
  6) score its trajectories with the reward function, if any (off the engine path);
  7) hand the finished group to its destination as soon as its last sample ends: the learner's
     queue (after logging it to `queue.durable_dir`, when set) or the caller's `Submission`.
Steps 4-7 of the learner's plain groups (no episode, session or request timeout) are callbacks,
not a task per group (`rollout.scheduling.callback_group`: the lobby starts one when room comes free, the
engine's results frames complete it); the rest run as a task each (`_run_group`).
One task group (the engine's) owns every in-flight group; cancelling it aborts the engine requests.
A source that raises ends with a failed group saying why; the others go on.
Does not own: engines (`runner`), hand-out order and capacity (`queue`).
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskGroup

from rollout.config import Config
from rollout.episodes.chat import ChatRenderer
from rollout.episodes.env import EnvError, EnvFactory
from rollout.episodes.loop import run_episode
from rollout.epochs import kv_runs
from rollout.errors import EngineDeadError, InvalidPromptError, RetryableError, RolloutError
from rollout.handout.durable import DurableLog
from rollout.handout.queue import Submission, TrajectoryQueue
from rollout.handout.staleness import Admission, trainable
from rollout.inputs.prompts import BadPrompt, Checked, ModelLimits, check_prompt, coerce, effective_sampling
from rollout.inputs.rewards import RewardFn, score
from rollout.inputs.usercode import passes_through
from rollout.log import get_logger
from rollout.scheduling.callback_group import CallbackGroup
from rollout.scheduling.lobby import Lobby
from rollout.scheduling.protocols import Engine
from rollout.scheduling.runner import Runner, failed
from rollout.types import Group, Prompt, Request, Sampling, Trajectory

log = get_logger(__name__)
Destination = TrajectoryQueue | Submission
MAX_SESSIONS = 65536  # sessions remembered; a forgotten one starts over on any engine


class Scheduler:
    def __init__(
        self,
        cfg: Config,
        engines: Sequence[Engine],
        queue: TrajectoryQueue,
        limits: ModelLimits,
        on_trajectory: Callable[[Trajectory], None] | None = None,
        reward: RewardFn | None = None,
        durable: DurableLog | None = None,
        on_engine_dead: Callable[[int], bool] | None = None,
        env: EnvFactory | None = None,
        chat: ChatRenderer | None = None,
    ):
        self.cfg = cfg
        self.queue = queue
        self.limits = limits
        self.on_trajectory = on_trajectory
        self.reward = reward
        self.durable = durable
        self.env = env
        self.chat = chat
        self.runner = Runner(cfg, engines, on_engine_dead, self._all_dead)
        self.lobby = Lobby(self.runner)
        self._stopped = False  # every engine is dead: no prompt is read any more
        self._failed: RolloutError | None = None  # why nothing can run any more (`fail`)
        self._direct = (
            env is None and cfg.engines.request_timeout_s is None
        )  # the learner's plain groups run as `CallbackGroup`s
        self.callback_groups: set[CallbackGroup] = set()  # those started on an engine, not yet complete
        self._spawned: set[asyncio.Task] = set()  # tasks they need meanwhile (`spawn`)
        self.admission = Admission(cfg.staleness)
        self._sources: deque[AsyncIterator] = deque()
        self._new_source = asyncio.Event()
        self._submissions: set[Submission] = set()
        self._tg: TaskGroup | None = None
        self._numbers = 0  # groups started, for request ids
        # session -> (engine, cache salt, kv_epochs) of its last turn; the oldest forgotten first
        self._sessions: OrderedDict[str, tuple[int, str, list[tuple[int, int]]]] = OrderedDict()

    # -- sources -----------------------------------------------------------------------------

    def add_source(self, source: AsyncIterator) -> None:
        """Queue a prompt source for the learner; it is read lazily, after the ones fed before it."""
        self._sources.append(source)
        self.queue.producer_started()
        self._new_source.set()

    def submit(self, submission: Submission) -> None:
        """Run a caller's prompts now, alongside everything else; their groups go to `submission`."""
        assert self._tg is not None, "the scheduler is not running"
        if self._failed is not None:  # nothing can run it: the caller hears why at once, not never
            submission.fail(self._failed)
            return
        self._submissions.add(submission)
        self._tg.start_soon(self._or_fail, self._run_submission, submission)

    def start(self, tg: TaskGroup) -> None:
        """Run in `tg` (the engine's): the learner's sources, the health watch, and every group."""
        self._tg = tg
        tg.start_soon(self._or_fail, self._read_sources, tg)
        tg.start_soon(self._or_fail, self.runner.watch)
        tg.start_soon(self._stop_direct_at_exit)

    def spawn(self, fn: Callable[..., Awaitable[None]], *args: object) -> asyncio.Task:
        """Run `fn(*args)` as a task (a callback group's work that must wait), from a callback too
        (where anyio's task group cannot start one); cancelled when the engine's task group is."""
        task = asyncio.get_running_loop().create_task(fn(*args))
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)
        return task

    async def _stop_direct_at_exit(self) -> None:
        """When the engine's task group is cancelled, abort the callback groups' engine requests (as
        cancelling a group's task does) and cancel the tasks they spawned."""
        try:
            await anyio.sleep_forever()
        finally:
            self.lobby.close()  # the cancelled groups' room comes back: no waiting one starts on it
            for group in list(self.callback_groups):
                group.stop()
            self.callback_groups.clear()
            for task in self._spawned:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*self._spawned, return_exceptions=True)

    async def _or_fail(self, fn: Callable[..., Awaitable[None]], *args: object) -> None:
        """Run one of the engine task group's long-lived tasks. If it dies, nothing may ever reach
        the queue again: whoever waits for a group (now or later) gets EngineDeadError saying why.
        Not re-raised: that would cancel the task group's host, the learner's own task, mid-call."""
        try:
            await fn(*args)
        except Exception as e:
            log.error(
                "scheduler task died",
                task=fn.__name__,
                error=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc(limit=6),
            )
            self.fail(EngineDeadError(f"the scheduler stopped: {fn.__name__} raised {type(e).__name__}: {e}"))

    async def _read_sources(self, tg: TaskGroup) -> None:
        """Read the learner's sources forever, one after another, starting groups in `tg`."""
        while True:
            if not self._sources:
                self._new_source = asyncio.Event()
                await self._new_source.wait()
                continue
            items = self._sources[0].__aiter__()
            try:
                while True:
                    try:
                        item = await items.__anext__()
                    except StopAsyncIteration:
                        break
                    except Exception as e:  # the source itself failed: say so in a group; the rest goes on
                        reason = (
                            str(e) if isinstance(e, RolloutError) else f"prompt source raised {type(e).__name__}: {e}"
                        )
                        log.error("prompt source failed", error=reason, traceback=traceback.format_exc(limit=4))
                        seq = await self.queue.reserve()
                        await self._deliver(Group(prompt_id="", prompt=Prompt(), error=reason), seq, self.queue)
                        break
                    if not await self._admit(coerce(item), tg, self.queue, True):
                        return
            finally:
                self._sources.popleft()
                self.queue.producer_done()

    async def _run_submission(self, sub: Submission) -> None:
        try:
            with sub.scope:
                async with anyio.create_task_group() as tg:
                    for index, prompt in enumerate(sub.prompts):
                        if not await self._admit(prompt, tg, sub, sub.train, index):
                            return
        finally:
            self._submissions.discard(sub)

    def _all_dead(self, error: EngineDeadError) -> None:
        self._stopped = True
        self.fail(error)

    def fail(self, error: RolloutError) -> None:
        """Nothing can run any more: whoever waits for a group gets `error` instead."""
        if isinstance(error, EngineDeadError):
            log.error("scheduler stopped", error=str(error))
        self._failed = self._failed or error
        self.queue.fail(error)
        for sub in list(self._submissions):
            sub.fail(error)

    # -- one group ---------------------------------------------------------------------------

    async def _admit(
        self, item: Prompt | BadPrompt | Checked, tg: TaskGroup, dest: Destination, train: bool, index: int = 0
    ) -> bool:
        """Start one prompt's group in `tg`. False when no engine is left to run it."""
        if train:
            await self.admission.acquire()
        if dest is self.queue:
            seq = await self.queue.reserve()
        else:
            await anyio.lowlevel.checkpoint()  # the group started before this one enters the lobby first
            await self.lobby.room(self.cfg.queue.max_groups)
            seq = index
        self._numbers += 1
        try:
            return await self._start(item, tg, dest, train, seq, self._numbers)
        except Exception as e:  # a bug must not leave `seq` waiting forever: this group fails, the rest goes on
            await self.crashed(e, item.prompt if isinstance(item, Checked) else item, seq, dest, train)
            return True

    async def _start(
        self, item: Prompt | BadPrompt | Checked, tg: TaskGroup, dest: Destination, train: bool, seq: int, number: int
    ) -> bool:
        queued_at = time.time()
        if isinstance(item, BadPrompt):
            await self._reject(Group(prompt_id=item.id, prompt=Prompt(id=item.id), error=item.reason), seq, dest, train)
            return True
        # A listed prompt was checked when it was fed or submitted (`check_all`); one read lazily is checked now.
        prompt, sampling = (item.prompt, item.sampling) if isinstance(item, Checked) else (item, None)
        if not prompt.id:
            prompt = msgspec.structs.replace(prompt, id=f"p{number}")
        if sampling is None:
            try:
                sampling = effective_sampling(self.cfg.sampling, prompt)
                check_prompt(prompt, sampling, self.limits)
            except InvalidPromptError as e:
                await self._reject(Group(prompt_id=prompt.id, prompt=prompt, error=str(e)), seq, dest, train)
                return True
        cost = len(prompt.token_ids or prompt.text or "") + sampling.max_tokens
        if self._direct and dest is self.queue and prompt.session is None:
            group = CallbackGroup(self, prompt, sampling, number, seq, cost, queued_at, train)
            self.lobby.add(group, sampling.max_tokens)
            return not self._stopped
        session = self._sessions.get(prompt.session) if prompt.session is not None else None
        tg.start_soon(self._run_guarded, prompt, sampling, number, seq, cost, queued_at, dest, train, session)
        return not self._stopped

    async def _run_guarded(self, *args: Any) -> None:
        """`_run_group`, a task nobody awaits: an exception in it (a bug, a callback that raised)
        fails this group with the reason instead of the engine's task group and everything in it."""
        try:
            await self._run_group(*args)
        except BaseException as e:  # what user code raised on the loop (a callback's SystemExit) too
            if passes_through(e):  # our own cancellation, or Ctrl-C
                raise
            prompt, _, _, seq, _, _, dest, train, _ = args
            await self.crashed(e, prompt, seq, dest, train)

    async def crashed(
        self, error: BaseException, item: Prompt | BadPrompt, seq: int, dest: Destination, train: bool
    ) -> None:
        """Group `seq` failed for a reason of ours, not the engine's: hand it in failed, with the reason."""
        reason = f"scheduler: {type(error).__name__}: {error}"
        log.error("group failed", prompt=item.id, error=reason, traceback=traceback.format_exc(limit=6))
        prompt = item if isinstance(item, Prompt) else Prompt(id=item.id)
        try:
            await self._reject(Group(prompt_id=item.id, prompt=prompt, error=reason), seq, dest, train)
        except Exception as e:  # it cannot even be delivered: the learner would wait for it forever
            if dest is self.queue:
                self.fail(EngineDeadError(f"{reason}; and it could not be delivered: {type(e).__name__}: {e}"))

    def crash(self, error: BaseException, prompt: Prompt, seq: int, train: bool) -> None:
        """A callback group of the learner's failed for a reason of ours (`CallbackGroup.crash`): into its
        queue failed, with the reason, from a task (a callback cannot wait)."""
        self.spawn(self.crashed, error, prompt, seq, self.queue, train)

    async def _reject(self, group: Group, seq: int, dest: Destination, train: bool) -> None:
        if train:
            self.admission.release()  # never trained on
        await self._deliver(group, seq, dest)

    async def _run_group(
        self, prompt: Prompt, sampling: Sampling, number: int, seq: int, cost: int, queued_at: float,
        dest: Destination, train: bool, session: tuple[int, str, list[tuple[int, int]]] | None = None,
    ) -> None:  # fmt: skip
        try:  # a session's turn waits for the engine holding its KV; the rest wait their turn in the lobby
            if session:
                i = await self.runner.acquire(sampling.n, cost, on=session[0])
            else:
                i = await self.lobby.acquire(sampling.n, cost, sampling.max_tokens)
        except EngineDeadError as e:  # said once, not once per group waiting
            if not self._stopped:
                self._stopped = True
                self.fail(e)
            dest.fail(self._failed or e)  # a group that came after the first to hear it
            return
        salt = (session[1] if session else f"s:{prompt.session}") if prompt.session is not None else None
        stream = dest.stream(seq) if isinstance(dest, Submission) and self.env is None else None
        requests = [
            Request(
                f"r{number}-{k}",
                prompt.id,
                k,
                sampling,
                token_ids=prompt.token_ids,
                text=prompt.text,
                cache_salt=salt,
                stream=stream is not None,
            )  # fmt: skip
            for k in range(sampling.n)
        ]
        done: dict[int, Trajectory] = {}

        def finish(traj: Trajectory) -> None:
            traj.queued_at = queued_at
            done[traj.sample_index] = traj
            if self.on_trajectory is not None:
                self.on_trajectory(traj)

        if self.env is None:
            await self.runner.run(i, requests, cost, finish, stream)
        else:
            self.runner.release(i, sampling.n, cost)  # an episode holds room on its engine only while a turn runs
            async with anyio.create_task_group() as tg:
                for req in requests:
                    tg.start_soon(self._episode, i, req, prompt, finish)
        trajectories = [done[k] for k in range(sampling.n)]
        if prompt.session is not None:
            self._continue(prompt.session, trajectories[0], session[2] if session else [])
        await self._scored_in(prompt, trajectories, seq, dest, train)

    def complete(self, prompt: Prompt, trajectories: list[Trajectory], seq: int, train: bool) -> None:
        """A callback group's last sample ended: into the learner's queue now, or after a task scores
        it and the durable log holds it."""
        if self.reward is not None or self.durable is not None:
            self.spawn(self._guarded_in, prompt, trajectories, seq, train)
            return
        group = Group(prompt_id=prompt.id, prompt=prompt, trajectories=trajectories)
        if train and not trainable(group):
            self.admission.release()  # every sample failed: never trained on
        self.queue.put(group, seq)

    async def _guarded_in(self, prompt: Prompt, trajectories: list[Trajectory], seq: int, train: bool) -> None:
        try:
            await self._scored_in(prompt, trajectories, seq, self.queue, train)
        except BaseException as e:
            if passes_through(e):
                raise
            await self.crashed(e, prompt, seq, self.queue, train)

    async def _scored_in(
        self, prompt: Prompt, trajectories: list[Trajectory], seq: int, dest: Destination, train: bool
    ) -> None:
        """Score a finished group's trajectories (the reward function, if any), then hand it in."""
        if self.reward is not None:
            async with anyio.create_task_group() as tg:
                for t in trajectories:
                    tg.start_soon(score, self.reward, prompt, t)
        group = Group(prompt_id=prompt.id, prompt=prompt, trajectories=trajectories)
        if train and not trainable(group):
            self.admission.release()  # every sample failed: never trained on
        await self._deliver(group, seq, dest)

    def _continue(self, session: str, turn: Trajectory, before: list[tuple[int, int]]) -> None:
        """Remember where a session's turn ran and what its KV holds, for the session's next turn."""
        if not turn.ok:
            return
        turn.kv_epochs = kv_runs(len(turn.prompt_token_ids), len(turn.token_ids), turn.policy_epochs,
                                 turn.kv_recomputes, turn.kv_reused, before)  # fmt: skip
        self._sessions[session] = (turn.engine_id, turn.cache_salt, turn.kv_epochs)
        self._sessions.move_to_end(session)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    async def _episode(self, i: int, request: Request, prompt: Prompt, finish: Callable[[Trajectory], None]) -> None:
        """One sample as an episode (`rollout.episodes.loop`), its turns kept on engine `i` while it serves."""
        assert self.env is not None
        engine = i

        async def run_turn(turn: Request) -> Trajectory:
            nonlocal engine
            cost = len(turn.token_ids or ()) + turn.sampling.max_tokens
            got: list[Trajectory] = []
            engine = await self.runner.acquire(1, cost, on=engine)
            engine = await self.runner.run(engine, [turn], cost, got.append)
            return got[0]

        try:
            env = self.env()
        except BaseException as e:  # user code: SystemExit too (`rollout.inputs.usercode`)
            if passes_through(e):
                raise
            finish(
                failed(
                    request,
                    i,
                    f"episode {request.request_id}: {EnvError(f'environment raised {type(e).__name__}: {e}')}",
                )
            )
            return
        try:
            episode = await run_episode(request, prompt, env, self.cfg.episode, self.limits, self.chat, run_turn)
        except EngineDeadError as e:
            episode = failed(request, engine, str(e))
        except BaseException as e:  # a bug of ours on an odd answer: this episode fails, not its group
            if passes_through(e):
                raise
            log.error(
                "episode failed",
                request=request.request_id,
                error=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc(limit=6),
            )
            episode = failed(request, engine, f"episode {request.request_id}: {type(e).__name__}: {e}")
        finish(episode)

    async def deliver(self, group: Group) -> None:
        """A group finished elsewhere (an episode served over HTTP) into the learner's queue, counted
        by staleness admission as if it had run here. Raises RetryableError when the queue is full."""
        if (seq := self.queue.try_reserve()) is None:
            raise RetryableError(f"the learner's queue is full (queue.max_groups={self.queue.max_groups}): try again")
        self.admission.running += 1  # its hand-out counts it accepted, or releases it
        await self._deliver(group, seq, self.queue)

    async def _deliver(self, group: Group, seq: int, dest: Destination) -> None:
        """To the caller's submission, or into the learner's queue after the durable log holds it."""
        if dest is self.queue and self.durable is not None:
            await anyio.to_thread.run_sync(self.durable.append, group)
        dest.put(group, seq)
