"""`TpRunner`: one model over N GPUs of this host, seen by the engines as one runner.

Each rank is a `GpuRunner` on its GPU over its share of the model (`shard.py`) and its share of every KV block
(its key/value heads): the block ids, the step buffer and the scheduler are the leader's, one of each. The ranks'
captured graphs carry the tensor-parallel kernels (kernels/tp_comm.py): the leader's graphs start by pushing
their step buffer to the followers (announce), the followers' start by waiting for it, and both all-reduce
twice per layer over peer memory. So a step needs no host work beyond what one GPU needs:
- host mode: the engine loop fills the leader's step buffer; `run` replays each follower's graph of the bucket,
  then the leader's (which uploads, announces, computes, samples); the followers follow on their own GPUs.
- persistent mode: the leader is the ordinary GPU-resident loop (gpu_backend/engine/persistent.py); each
  follower runs a small device-launched loop (`start_followers`) that waits for the leader's announce and
  launches its graph of that (step buffer, bucket). The host watches `error()` once a second.
Why one process and one scheduler, not one per rank: the ring, its gateway connection and every scheduling
decision exist once; the followers cannot disagree with the leader because they receive its step, not decide
it. The cost is the announce's copy of the used step buffer (a few KB at small batch) over NVLink per step.
A rank that dies or stalls: its peers' waits time out (BLINK_TP_TIMEOUT_S, default 10 s), set the shared
fault word and stop waiting; the engines see it (`error()`), fail what is in flight and stop.
Eager mode (use_graphs=False) launches the followers' steps before the leader's, on their own streams: meant
for tests on small models (a follower's launch queue holds its whole step while it waits for the leader).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from gpu_backend.engine.gpu_runner import GpuRunner, GpuRunnerConfig
from gpu_backend.engine.graph_variant import GraphVariant
from gpu_backend.engine.step_buffers import ScheduledStep
from gpu_backend.models import ModelConfig
from kernels.tp_comm import DEFAULT_TIMEOUT_S, FollowerLoop, TpComm

log = logging.getLogger("blink.parallel")


class TpRunner:
    """The leader's GpuRunner for the engines (every attribute not defined here is the leader's), plus the
    followers. `models[r]` is rank r's model (of `local_cfg`'s shape) on `devices[r]`."""

    def __init__(self, models: list[torch.nn.Module], local_cfg: ModelConfig, config: GpuRunnerConfig,
                 devices: list[torch.device], keep_graphs: bool = False, progress: bool = True,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if len(models) != len(devices) or len(devices) < 2:
            raise ValueError("tensor parallelism needs one model per device and at least two devices")
        self.world, self.devices = len(devices), [torch.device(d) for d in devices]
        self.comm = TpComm([d.index for d in self.devices], config.max_num_batched_tokens * local_cfg.hidden_size,
                           timeout_s)
        self.comm.set_live(False)  # sizing, warm-up and capture run each rank alone
        with torch.cuda.device(self.devices[0]):
            self.leader = GpuRunner(models[0], local_cfg, config, self.devices[0], progress, keep_graphs,
                                    tp=self.comm.rank(0))
        follower_config = dataclasses.replace(config, num_kv_blocks=self.leader.num_blocks)
        self.followers: list[GpuRunner] = []
        for rank in range(1, self.world):
            with torch.cuda.device(self.devices[rank]):
                self.followers.append(GpuRunner(models[rank], local_cfg, follower_config, self.devices[rank],
                                                progress, keep_graphs, tp=self.comm.rank(rank)))
        for rank, runner in enumerate(self.ranks):
            if runner.num_blocks != self.leader.num_blocks:
                raise RuntimeError(f"rank {rank} holds {runner.num_blocks} KV blocks, the leader {self.leader.num_blocks}")
            for index, bufs in enumerate(runner.buffer_sets):
                self.comm.set_step_buffer(rank, index, bufs.dev.data_ptr(), bufs.offsets["block_tables"][0],
                                          4 * bufs.max_blocks, bufs.offsets["num_seqs"][0])
        for device in self.devices:
            torch.cuda.synchronize(device)
        self.comm.set_live(True)
        self._loops: list[FollowerLoop] = []
        log.info("tensor parallel over GPUs %s: %d KV blocks on each", [d.index for d in self.devices],
                 self.leader.num_blocks)

    @property
    def ranks(self) -> list[GpuRunner]:
        return [self.leader, *self.followers]

    def __getattr__(self, name: str):
        return getattr(self.__dict__["leader"], name)

    # ---- host mode -------------------------------------------------------------------------------------
    def _followers_step(self, bucket: int) -> None:
        """Each follower's step of `bucket` queued on its GPU (it starts when the leader announces)."""
        for f in self.followers:
            with torch.cuda.device(f.device):
                if f.config.use_graphs:
                    f.graphs[(bucket, GraphVariant.SAMPLE)].replay()
                else:
                    f._step(bucket, GraphVariant.SAMPLE)

    @torch.inference_mode()
    def _together(self, leader_call, step: ScheduledStep):
        """The followers' step queued, then the leader's call (GpuRunner.run, logits, sampled_logits) on its GPU;
        raises when a rank failed meanwhile."""
        self._followers_step(step.bucket)
        with torch.cuda.device(self.devices[0]):
            out = leader_call(step)
        self.check()
        return out

    def run(self, step: ScheduledStep) -> list[int]:
        return self._together(self.leader.run, step)

    def logits(self, step: ScheduledStep) -> torch.Tensor:
        return self._together(self.leader.logits, step)

    def sampled_logits(self, step: ScheduledStep) -> torch.Tensor:
        return self._together(self.leader.sampled_logits, step)

    def check(self) -> None:
        """Raise when a rank stalled or died (a peer's wait timed out)."""
        message = self.error()
        if message:
            raise RuntimeError(message)

    def error(self) -> str | None:
        fault = self.comm.fault
        if fault:
            return (f"tensor parallel: rank {fault - 1} waited {self.comm.timeout_s:g} s for a peer "
                    "(a GPU of the group died or stalled)")
        for loop in self._loops:
            status = loop.poll()
            if status not in (0, 1):
                return f"tensor parallel: rank {loop.rank}'s loop failed (cudaError {status})"
            if status == 1 and not self._stopping:
                return f"tensor parallel: rank {loop.rank}'s loop ended on its own"
        return None

    # ---- persistent mode -------------------------------------------------------------------------------
    _stopping = False

    def start_followers(self) -> None:
        """Build and launch each follower's device loop over its kept graphs (before the leader's loop)."""
        self._stopping = False
        for f in self.followers:
            if not f.keep_graphs:
                raise ValueError("the followers' loops need their graphs kept (keep_graphs=True)")
            graphs = [f.set_graphs[i][(bucket, GraphVariant.SAMPLE)].raw_cuda_graph()
                      for i in range(2) for bucket in f.buckets]
            with torch.cuda.device(f.device):
                torch.cuda.synchronize(f.device)
                loop = self.comm.follower_loop(f.tp.rank, graphs, len(f.buckets))
                loop.launch()
            self._loops.append(loop)

    def stop_followers(self, timeout_s: float = 30.0) -> None:
        """After the leader's loop ended: the followers' loops end at their next wait."""
        self._stopping = True
        self.comm.set_stop(True)
        deadline = time.monotonic() + timeout_s
        for loop in self._loops:
            while loop.poll() == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            if loop.poll() == 0:
                log.error("rank %d's loop did not stop within %.0f s; leaving it to the process exit", loop.rank,
                          timeout_s)
                return
        for loop in self._loops:  # the runner can serve again: host steps, or another loop
            loop.close()
        self._loops = []
        self.comm.set_stop(False)
