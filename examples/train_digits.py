"""Small DDP training example: an MLP on scikit-learn's bundled digits dataset.

Needs no download. Launch it with any torchrun-compatible launcher, e.g.::

    fsm-agent run --standalone --nproc-per-node 2 examples/train_digits.py
    torchrun --standalone --nproc-per-node 2 examples/train_digits.py

The script reads RANK, LOCAL_RANK, WORLD_SIZE and TORCHELASTIC_RESTART_COUNT
from the environment and uses NCCL on GPUs or gloo on CPUs. At the end of each
epoch rank 0 saves a checkpoint (model, optimizer, epoch) atomically. After a
restart every rank resumes from the epoch after the last checkpoint.

With ``fsm-agent run --checkpoint-memory 16MiB`` every rank also saves each epoch into the agent's
shared memory (``fsm_agent.checkpoint``, docs/checkpoints.md): a copy that returns at once, which
the agent persists (``--checkpoint-dir``) and replicates to a peer node in the background; a
restart then resumes from that copy ("resumed from epoch N (memory)") before the file.

For testing restarts, ``--crash-rank R --crash-epoch E`` makes rank R fail at the
start of epoch E on the first attempt only. It raises RuntimeError, or calls
sys.exit(C) if you pass ``--crash-exit-code C``. Add ``--crash-always`` to make it
fail on every attempt. Epochs are numbered from 1. An existing checkpoint is
always resumed, so delete it (or pass a new ``--checkpoint``) to start afresh.

``--checkpoint-on-signal`` (for schedulers, see examples/slurm/train.sbatch): SIGUSR1 (a time-limit
warning the agent passes on with ``--forward-signals SIGUSR1``) makes rank 0 save a checkpoint after
the current batch and training go on; SIGTERM (preemption, the agent stopping the workers) saves one
and every rank exits 143. The ranks agree on it after each batch (one small all_reduce), so every
rank stops at the same batch. A checkpoint saved mid-epoch resumes at the start of that epoch.
``--stop-file PATH`` ends training after the epoch in which PATH appears, as if ``--epochs`` had
been reached (the tests end an open-ended run this way).
"""

import argparse
import gc
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fsm_agent
from fsm_agent import checkpoint


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32, help="per-process batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=os.path.join("runs", "digits_ckpt.pt"))
    p.add_argument("--result-file", default=None, help="rank 0 writes a JSON summary here")
    p.add_argument("--crash-rank", type=int, default=None)
    p.add_argument("--crash-epoch", type=int, default=None)
    p.add_argument("--crash-exit-code", type=int, default=None)
    p.add_argument("--crash-always", action="store_true", help="crash on every attempt")
    p.add_argument(
        "--stop-file",
        default=None,
        help="end training after the epoch in which this file appears (as if --epochs were reached)",
    )
    p.add_argument(
        "--checkpoint-on-signal",
        action="store_true",
        help="SIGUSR1: checkpoint and go on; SIGTERM: checkpoint and exit 143",
    )
    return p.parse_args(argv)


def load_data(seed):
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_tr)
    as_t = lambda a, dt: torch.tensor(a, dtype=dt)  # noqa: E731
    return (
        TensorDataset(as_t(scaler.transform(x_tr), torch.float32), as_t(y_tr, torch.long)),
        as_t(scaler.transform(x_te), torch.float32),
        as_t(y_te, torch.long),
    )


#: What the last signal asked for: 0 nothing, 1 checkpoint (SIGUSR1), 2 checkpoint and stop (SIGTERM).
SIGNAL_ASKS = {signal.SIGUSR1: 1, signal.SIGTERM: 2}
asked = 0


def on_signal(signum, _frame):
    global asked
    asked = max(asked, SIGNAL_ASKS[signum])


def save_atomic(obj, path):
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


@record
def main(argv=None):
    global asked
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    if torch.cuda.is_available():
        backend, device = "nccl", torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, init_method="env://")
    if args.checkpoint_on_signal:
        for signum in SIGNAL_ASKS:
            signal.signal(signum, on_signal)

    train_ds, x_test, y_test = load_data(args.seed)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    start_epoch, resumed_from = 1, None
    # Run with ``fsm-agent run --checkpoint-memory 16MiB``: every rank also saves each epoch into the
    # agent's memory, and a restart restores from there (or a peer node's replica), not from disk.
    restored = checkpoint.load() if checkpoint.enabled() else None
    if restored is not None:
        model.load_state_dict(restored.state_dict["model"])
        opt.load_state_dict(restored.state_dict["optimizer"])
        resumed_from = restored.step
        start_epoch = resumed_from + 1
        print(f"[rank {rank}] resumed from epoch {resumed_from} ({restored.source})", flush=True)
    elif os.path.exists(args.checkpoint):
        ckpt = torch.load(args.checkpoint, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        resumed_from = ckpt["epoch"]
        start_epoch = resumed_from + 1
        print(f"[rank {rank}] resumed from epoch {resumed_from}", flush=True)
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    try:
        loss_fn = nn.CrossEntropyLoss()

        for epoch in range(start_epoch, args.epochs + 1):
            if rank == args.crash_rank and epoch == args.crash_epoch and (args.crash_always or restart_count == 0):
                print(f"[rank {rank}] injecting crash at epoch {epoch} (restart {restart_count})", flush=True)
                if args.crash_exit_code is not None:
                    sys.exit(args.crash_exit_code)
                raise RuntimeError(f"injected crash on rank {rank} at epoch {epoch}")

            ddp.train()
            sampler.set_epoch(epoch)
            stats = torch.zeros(3, device=device)  # summed loss, number of samples, ranks that saw --stop-file
            for step, (xb, yb) in enumerate(loader, (epoch - 1) * len(loader) + 1):
                xb, yb = xb.to(device), yb.to(device)
                opt.zero_grad()
                with fsm_agent.compute():  # the forward pass has no collective: this rank's own time
                    loss = loss_fn(ddp(xb), yb)
                    if device.type == "cuda":
                        torch.cuda.synchronize()  # time the kernels, not their launch
                loss.backward()  # DDP's gradient all_reduce: every rank waits for the slowest here
                opt.step()
                fsm_agent.heartbeat(step=step)  # steps (and the compute time above) for --straggler-window
                stats += torch.tensor([loss.item() * len(yb), len(yb), 0.0], device=device)
                if args.checkpoint_on_signal:
                    wanted = torch.tensor([asked], device=device)
                    dist.all_reduce(wanted, op=dist.ReduceOp.MAX)  # every rank decides at the same batch
                    if wanted.item():
                        if rank == 0:
                            save_atomic(
                                {
                                    "model": model.state_dict(),
                                    "optimizer": opt.state_dict(),
                                    "epoch": epoch - 1,
                                    "signal": int(wanted.item()),
                                },
                                args.checkpoint,
                            )
                            print(
                                f"[rank 0] checkpoint saved on {'SIGTERM' if wanted.item() == 2 else 'SIGUSR1'} "
                                f"in epoch {epoch}",
                                flush=True,
                            )
                        if wanted.item() == 2:
                            dist.barrier()
                            sys.exit(128 + signal.SIGTERM)
                        asked = 0
            stats[2] = float(bool(args.stop_file) and os.path.exists(args.stop_file))
            dist.all_reduce(stats)

            if checkpoint.enabled():  # a memory copy: returns once copied; the agent persists it
                checkpoint.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step=epoch)
            if rank == 0:
                print(f"epoch {epoch}/{args.epochs} loss {(stats[0] / stats[1]).item():.4f}", flush=True)
                os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
                save_atomic(
                    {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch}, args.checkpoint
                )
            dist.barrier()
            if stats[2].item():
                print(f"[rank {rank}] {args.stop_file} appeared: training ends after epoch {epoch}", flush=True)
                break

        model.eval()
        with torch.no_grad():
            acc = (model(x_test.to(device)).argmax(1) == y_test.to(device)).float().mean().item()
        if rank == 0:
            print(f"final test accuracy: {acc:.3f}", flush=True)
            if args.result_file:
                result = {
                    "test_accuracy": acc,
                    "epochs": args.epochs,
                    "world_size": world,
                    "resumed_from": resumed_from,
                    "restart_count": restart_count,
                    "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                }
                os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
                tmp = f"{args.result_file}.tmp"
                with open(tmp, "w") as f:
                    json.dump(result, f)
                os.replace(tmp, args.result_file)
        dist.barrier()
    finally:
        # Release DDP before destroying the group, on every way out (a crash and sys.exit too): its
        # reducer keeps the gloo process group alive, and one that lives on into interpreter shutdown
        # can abort the worker at exit (SIGABRT/SIGSEGV in about 1 of 10 runs on a loaded machine,
        # under torchrun too), which then hides the exit code of the error it raised.
        del ddp
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
