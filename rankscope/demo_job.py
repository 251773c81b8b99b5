"""Train a small GPT-style language model with DistributedDataParallel, launched by torchrun.

    torchrun --nproc-per-node 4 rankscope/demo_job.py --seconds 60
    RANKSCOPE_SPOOL=/tmp/spool torchrun --nproc-per-node 4 rankscope/demo_job.py --fault slow_data --fault-rank 2

A user's training script, written the way such scripts are written: a map-style ``Dataset`` over
a tokenized corpus (synthetic here, stored compressed as it would be on disk), a ``DataLoader``
with a ``DistributedSampler``, a two-block transformer, AdamW, and rank 0 logging the loss,
evaluating on a held-out batch and saving a checkpoint now and then. rankscope's hook is attached
at its defaults, as its README shows (``--attach start``) or where people add it to a script they
have, after DDP and the optimizer are built (``--attach loop``).

Faults, for rankscope's fault suite (each only on ``--fault-rank``, from ``--onset-s`` seconds into
training on: rank 0 says when that time has passed through the small all-reduce every step
already makes, so that every rank agrees on the step):

``slow_data``        the rank's storage gets slow: every sample its ``Dataset.__getitem__`` reads
                     waits, ``--fault-ms`` per batch in all.
``slow_backward``    a degraded device: the rank's forward and backward do ``--fault-factor`` times
                     the work (its batch is padded with copies of its rows, sliced off again).
``metrics_block``    the rank calls ``upload_metrics()`` every step, a synchronous call that blocks
                     ``--fault-ms`` (a metrics endpoint answering slowly).
``hang_checkpoint``  the rank enters ``save_checkpoint()`` and never returns (its write waits on
                     storage that never answers) while its peers wait in DDP's all-reduce.
``crash``            the rank's process is killed (SIGKILL, as the kernel's OOM killer or a lost
                     node ends it) in the job's first attempt; under ``torchrun --max-restarts``
                     the job restarts and resumes from the latest checkpoint in ``--ckpt-dir``.
``cuda_error``       the rank raises what PyTorch raises when its GPU fails under it
                     (``RuntimeError: CUDA error: an illegal memory access was encountered``).
``oom``              the rank raises what PyTorch raises when its device runs out of memory
                     (``torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ...``).
``bad_sample``       the rank's next samples come from a truncated shard: its ``Dataset.__getitem__``
                     raises what ``zlib`` raises then (``zlib.error: Error -5 while decompressing
                     data: incomplete or truncated stream``), a failure of the job's own data.

Checkpoints are timed with ``hook.checkpoint()``, and steps numbered from the checkpoint a restart
resumes at (``hook.step(step)``), so that ``rankscope reliability`` sees the restarts, the
checkpoints' cost and the work redone.

With ``--marker-dir`` the faulty rank writes ``onset-r<rank>`` there (JSON: ``time``, ``step``) at
its first faulty step. The job ends by itself after ``--seconds`` (all ranks at the same step).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from rankscope import profiler_hook

FAULTS = (
    "none",
    "slow_data",
    "slow_backward",
    "metrics_block",
    "hang_checkpoint",
    "crash",
    "cuda_error",
    "oom",
    "bad_sample",
)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="train this long (rank 0's clock)")
    ap.add_argument("--job", default="", help="job id (default: $RANKSCOPE_JOB or torchrun's run id)")
    ap.add_argument("--spool-dir", default="", help="the hook's spool (default: $RANKSCOPE_SPOOL)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=96)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=250)
    ap.add_argument(
        "--ckpt-dir",
        default="",
        help="resume from its latest.pt if there is one (default: a temporary directory)",
    )
    ap.add_argument("--fault", choices=FAULTS, default=os.environ.get("LM_FAULT", "none"))
    ap.add_argument("--fault-rank", type=int, default=int(os.environ.get("LM_FAULT_RANK", "1")))
    ap.add_argument("--onset-s", type=float, default=float(os.environ.get("LM_ONSET_S", "10")))
    ap.add_argument("--fault-ms", type=float, default=15.0, help="slow_data, metrics_block: extra ms")
    ap.add_argument("--fault-factor", type=float, default=1.7, help="slow_backward: work factor")
    ap.add_argument("--marker-dir", default="", help="write the onset marker here")
    ap.add_argument(
        "--attach",
        choices=("start", "loop"),
        default="start",
        help="attach the hook before the model (start) or after DDP and the optimizer (loop)",
    )
    return ap.parse_args()


# --- data ------------------------------------------------------------------------------------


def synthetic_corpus(n_seq: int, seq_len: int, vocab: int, seed: int = 0) -> np.ndarray:
    """``n_seq`` token sequences from a random sparse bigram model: a language with some structure."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 3.0
    probs = torch.softmax(logits, dim=1)
    tokens = torch.empty(n_seq, seq_len, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, vocab, (n_seq,), generator=g)
    for t in range(1, seq_len):
        tokens[:, t] = torch.multinomial(probs[tokens[:, t - 1]], 1, generator=g).squeeze(1)
    return tokens.numpy().astype(np.int16)


class TokenDataset(Dataset):
    """Samples of ``seq_len + 1`` tokens, each stored zlib-compressed (as a tokenized shard on disk)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.records = [zlib.compress(row.tobytes()) for row in tokens]
        self.read_delay_s = 0.0
        """Extra time each read takes (the slow_data fault sets it on its rank)."""
        self.truncated = False
        """The records read are cut short (the bad_sample fault sets it on its rank)."""

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        raw = self.records[i]
        if self.truncated:
            raw = raw[: len(raw) // 2]  # fault: a shard cut short (a copy that did not finish)
        if self.read_delay_s:
            time.sleep(self.read_delay_s)  # fault: a slow disk / network filesystem read
        row = torch.from_numpy(np.frombuffer(zlib.decompress(raw), dtype=np.int16).astype(np.int64))
        return row[:-1], row[1:]


# --- model -----------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.n_head)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, n_head: int, n_layer: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def degraded_device(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Fault injection: the batch plus copies of its rows, so that every layer does ``factor``x the work."""
    extra = max(1, round(x.shape[0] * (factor - 1)))
    return torch.cat([x, x[torch.arange(extra) % x.shape[0]]])


# --- the things a training loop does besides training ----------------------------------------


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    model.train()
    return float(loss)


def save_checkpoint(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    ckpt_dir: str,
    storage: threading.Event | None = None,
) -> str:
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
    path = os.path.join(ckpt_dir, "latest.pt")
    if storage is not None:
        storage.wait()  # fault: the storage never acknowledges the write (a dead NFS server)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


def upload_metrics(metrics: dict, block_s: float) -> None:
    """A synchronous metrics call (fault: the endpoint answers only after ``block_s``)."""
    body = json.dumps(metrics).encode()
    time.sleep(block_s)  # waiting for the HTTP response
    del body


def write_marker(marker_dir: str, rank: int, step: int, kind: str) -> None:
    path = os.path.join(marker_dir, f"onset-r{rank}")
    with open(path + ".tmp", "w") as fh:
        json.dump({"time": time.time(), "step": step, "rank": rank, "kind": kind}, fh)
    os.replace(path + ".tmp", path)


# --- training --------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.attach == "start":
        hook = profiler_hook.attach(job=args.job, spool_dir=args.spool_dir)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fault = args.fault if rank == args.fault_rank and not (args.fault == "crash" and attempt > 0) else "none"

    corpus = synthetic_corpus(4096 + 64, args.seq_len + 1, args.vocab)
    train_set = TokenDataset(corpus[:4096])
    held_out = torch.from_numpy(corpus[4096:].astype(np.int64))
    eval_x, eval_y = held_out[:, :-1], held_out[:, 1:]
    sampler: DistributedSampler = DistributedSampler(train_set, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    raw_model = GPT(args.vocab, args.seq_len, args.d_model, args.n_head, args.n_layer)
    model = DistributedDataParallel(raw_model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    if args.attach == "loop":  # where people add a hook to a script they have
        hook = profiler_hook.attach(job=args.job, spool_dir=args.spool_dir)
    if rank == 0:
        n_params = sum(p.numel() for p in raw_model.parameters())
        print(f"rank 0: {world} ranks, {n_params / 1e3:.0f}k parameters, fault {args.fault}", flush=True)
    ckpt_dir = args.ckpt_dir or tempfile.mkdtemp(prefix="lm-ckpt-")
    os.makedirs(ckpt_dir, exist_ok=True)
    stuck_storage = threading.Event()  # never set: the faulty rank's checkpoint write never completes
    step = 0
    if os.path.exists(latest := os.path.join(ckpt_dir, "latest.pt")):
        with hook.checkpoint(load=True):
            state = torch.load(latest)
            raw_model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            step = state["step"] + 1
        if rank == 0:
            print(f"attempt {attempt}: resumed from the checkpoint of step {step - 1}", flush=True)

    start = time.perf_counter()
    epoch, onset_step, stop = 0, -1, False
    while not stop:
        sampler.set_epoch(epoch)
        for x, y in hook.wrap_loader(loader):
            with hook.step(step):
                faulty = fault != "none" and 0 <= onset_step <= step
                if faulty and step == onset_step and args.marker_dir:
                    write_marker(args.marker_dir, rank, step, fault)
                if faulty and fault == "crash":
                    os.kill(os.getpid(), signal.SIGKILL)
                if faulty and fault == "cuda_error":
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                if faulty and fault == "oom":
                    raise torch.OutOfMemoryError(
                        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB "
                        "of which 1.19 GiB is free."
                    )
                inp = degraded_device(x, args.fault_factor) if faulty and fault == "slow_backward" else x
                logits = model(inp)[: x.shape[0]]
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()

                # Rank 0 decides when to stop and when the fault's onset time has passed.
                flags = torch.zeros(2)
                if rank == 0:
                    elapsed = time.perf_counter() - start
                    flags[0] = float(elapsed >= args.seconds)
                    flags[1] = float(0 <= args.onset_s <= elapsed)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                stop = bool(flags[0])
                if flags[1] and onset_step < 0:
                    onset_step = step + 1
                    if fault == "slow_data":
                        train_set.read_delay_s = args.fault_ms / 1e3 / args.batch_size
                    train_set.truncated = fault == "bad_sample"

                opt.step()

                if faulty and fault == "metrics_block":
                    upload_metrics({"step": step, "loss": loss.item()}, args.fault_ms / 1e3)
                if rank == 0 and step % args.log_every == 0:
                    print(
                        f"step {step:5d}  loss {loss.item():.3f}  {time.perf_counter() - start:6.1f}s",
                        flush=True,
                    )
                if rank == 0 and step > 0 and step % args.eval_every == 0:
                    print(f"step {step:5d}  eval loss {evaluate(raw_model, eval_x, eval_y):.3f}", flush=True)
                if rank == 0 and step > 0 and step % args.ckpt_every == 0:
                    with hook.checkpoint():
                        save_checkpoint(raw_model, opt, step, ckpt_dir)
                if faulty and fault == "hang_checkpoint":
                    save_checkpoint(raw_model, opt, step, ckpt_dir, storage=stuck_storage)
            step += 1
            if stop:
                break
        epoch += 1

    if rank == 0:
        took = time.perf_counter() - start
        print(f"done: {step} steps in {took:.1f} s ({1e3 * took / max(step, 1):.1f} ms/step)", flush=True)
    hook.close()
    # The model goes before its process group. A DDP model sits in a reference cycle, which only a
    # garbage collection frees: left to the interpreter's exit, it frees gloo's group during
    # finalization, which can abort the process (pytorch/pytorch#179291: "terminate called without
    # an active exception"; a restarted attempt's rank 1 exited so once in CI).
    del model, raw_model, opt
    gc.collect()
    dist.destroy_process_group()
    if not args.ckpt_dir:
        shutil.rmtree(ckpt_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
