"""One rank of a ZeRO run for test_zero.py, launched as torchrun would (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): trains a small MLP and saves its losses and final parameters.

    python zero_worker.py OUT STAGE ACCUMULATION [PERSIST [DEVICE]]
        STAGE 0: stage 2 in one process, the plain engine; stage 3 in one process offloads the
        parameters. PERSIST: stage3_param_persistence_threshold (default 0: none stays).
        DEVICE: cpu (default) or cuda (the model and data there); cuda-nccl: cuda with an NCCL
        process group (rank r on GPU r), so that zoffload's collectives run over NCCL.
    ZERO_TEST_PARAM_NVME=DIR: stage 3's offload_param is "nvme" there, with a host cache smaller
    than the model (ZeRO then runs in one process too).
"""

import os
import sys

import torch

import zoffload
import zoffload.torch as zt

STEPS = 8


def data(step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.rand(6, 7, generator=g) * 2 - 1
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def main() -> None:
    out, stage, accumulation = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    persist = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
    torch.set_num_threads(1)  # the same sums in every process
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if device == "cuda-nccl":
        device = "cuda"
        torch.cuda.set_device(rank)
        torch.distributed.init_process_group("nccl")
    elif world > 1:
        torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5), torch.nn.Tanh(),
        torch.nn.Linear(5, 1)).to(device)
    config = {
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}},
        "zero_optimization": {"stage": max(stage, 2), "reduce_bucket_size": 30,
                              "stage3_param_persistence_threshold": persist,
                              "offload_optimizer": {"device": "cpu"}},
        "zoffload": {"cpu_adam_threads": 1},
    }
    # ZERO_TEST_DIE_AT_STEP=s: the last rank exits in step s's backward; the others must fail
    # within the (short) timeout, naming it, and exit 3.
    die_at = int(os.environ.get("ZERO_TEST_DIE_AT_STEP", "-1"))
    if die_at >= 0:
        config["zoffload"]["comm_timeout_seconds"] = 2
    nvme = os.environ.get("ZERO_TEST_PARAM_NVME", "")
    if stage == 3:
        config["zero_optimization"]["offload_param"] = (
            {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 60} if nvme else {"device": "cpu"})
    opt = zt.OffloadOptimizer(model.named_parameters(), config=config, model=model)
    assert (opt.zero is not None) == (world > 1 or bool(nvme)), "ZeRO used where it should not be"
    losses = []
    for step in range(STEPS):
        try:
            for a in range(accumulation):
                x, y = (t.to(device) for t in data(step, rank * accumulation + a))
                if step == die_at and rank == world - 1:
                    os._exit(0)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                losses.append(loss.item())
            opt.step()
        except zoffload.Error as e:
            if step != die_at:
                raise
            print(f"rank {rank}: {e}", flush=True)
            os._exit(3)
        if stage == 3:  # between steps the model holds only the persistent parameters
            for name, p in model.named_parameters():
                small = opt.parameter_values(name).numel() < persist
                assert (p.numel() > 0) == small, (name, p.numel())
    params = {name: opt.parameter_values(name).cpu() for name, _ in model.named_parameters()}
    if world > 1:  # partitioned state: no checkpoints yet, said clearly
        try:
            opt.state_dict()
            raise AssertionError("state_dict of a ZeRO run did not refuse")
        except zoffload.Unimplemented as e:
            assert "state_dict of a ZeRO run" in str(e), e
        opt.save(f"{out}.ckpt")  # every rank; rank 0 writes whole parameters
    torch.save({"losses": losses, "params": params}, f"{out}.rank{rank}")
    opt.close()
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
