"""ZeRO stages 1-3 through zoffload.torch, as torchrun runs them: two real processes over
torch.distributed (gloo, for the bootstrap) and zoffload's host shared-memory backend. Two ranks
taking one micro-batch each end with the bits of one process (the OffloadEngine) taking both as
accumulation steps: the same losses and parameters, at every stage. Stage 3 with offload_param
in one process (parameters fetched per module from host memory, or from NVMe) trains as the
plain engine.
Between uses, stage 3 keeps no parameter values in the model; under activation checkpointing
(torch.utils.checkpoint, transformers' gradient checkpointing) parameter offload trains as the
plain engine."""

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import zoffload
import zoffload.torch as zt

WORKER = os.path.join(os.path.dirname(__file__), "zero_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out, stage, accumulation, world, persist=0, device="cpu", param_nvme=""):
    """Runs zero_worker.py as `world` ranks; returns each rank's saved record. param_nvme: a
    directory for stage 3's parameters (offload_param "nvme")."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), ZERO_TEST_PARAM_NVME=str(param_nvme))
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, str(out), str(stage), str(accumulation), str(persist),
             device], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for rank, p in enumerate(procs):
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"rank {rank} of {world} (stage {stage}):\n{output}"
    return [torch.load(f"{out}.rank{r}") for r in range(world)]


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """The OffloadEngine in one process: accumulation 2 (and 1)."""
    d = tmp_path_factory.mktemp("engine")
    return {acc: launch(d / f"acc{acc}", 0, acc, 1)[0] for acc in (1, 2)}


@pytest.mark.parametrize("stage,persist", [(1, 0), (2, 0), (3, 0), (3, 20)])
def test_two_ranks_give_the_bits_of_one_process(tmp_path, engine_runs, stage, persist):
    """persist 20: the biases and the last weight (5 elements) stay on every rank."""
    ranks = launch(tmp_path / "zero", stage, 1, 2, persist)
    want = engine_runs[2]
    for name, values in want["params"].items():
        for r in (0, 1):
            assert torch.equal(ranks[r]["params"][name], values), (name, r)
    for r in (0, 1):  # rank r took micro-batch r of every step
        assert ranks[r]["losses"] == want["losses"][r::2]
    assert want["losses"][-1] < want["losses"][0]
    # The ranks' checkpoint loads into one process (the engine) with the same parameters.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5), torch.nn.Tanh(),
        torch.nn.Linear(5, 1))
    one = zt.OffloadOptimizer(model.named_parameters(), config={
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    one.load(f"{tmp_path / 'zero'}.ckpt")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), want["params"][name]), name
    one.close()


@pytest.mark.parametrize("persist", [0, 20])
def test_parameter_offload_in_one_process_equals_the_engine(tmp_path, engine_runs, persist):
    got = launch(tmp_path / "zero3", 3, 1, 1, persist)[0]
    want = engine_runs[1]
    assert got["losses"] == want["losses"]
    for name, values in want["params"].items():
        assert torch.equal(got["params"][name], values), name


def test_stage3_needs_the_model():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(zoffload.InvalidArgument, match="needs model="):
        zt.OffloadOptimizer(model.named_parameters(), config={
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "cpu"}}})
    with pytest.raises(zoffload.InvalidArgument, match="needs model="):
        zt.OffloadOptimizer(model.named_parameters(), config={
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}})


@pytest.mark.parametrize("world", [1, 2])
def test_parameters_on_nvme_give_the_bits_of_host_parameters(tmp_path, engine_runs, world):
    """offload_param "nvme" (a host cache of 60 elements for a 180-element model, so values
    are evicted and read back every step): one process, and two ranks, end with the engine's
    losses and parameters."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ranks = launch(tmp_path / "zero3", 3, 1, world, param_nvme=nvme)
    want = engine_runs[world]
    for r in range(world):
        assert ranks[r]["losses"] == want["losses"][r::world]
        for name, values in want["params"].items():
            assert torch.equal(ranks[r]["params"][name], values), (name, r)
    assert not any(nvme.rglob("*.swp")), "the parameters' swap files outlive the run"


def test_parameter_offload_keeps_checkpoints_and_reads_values(tmp_path):
    """Stage 3 in one process is the engine underneath: state_dict, save and load work, and
    parameter_values reads a parameter the model holds empty."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = zt.OffloadOptimizer(model.named_parameters(), model=model, config={
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                              "offload_param": {"device": "cpu"},
                              "stage3_param_persistence_threshold": 0}})
    assert all(p.numel() == 0 for p in model.parameters())
    assert torch.equal(opt.parameter_values("0.weight"), before["0.weight"])
    model(torch.ones(5, 3)).sum().backward()
    opt.step()
    assert not torch.equal(opt.parameter_values("0.weight"), before["0.weight"])
    state = opt.state_dict()
    assert torch.equal(state["state"]["1.bias"]["master"], opt.parameter_values("1.bias"))
    opt.save(tmp_path / "ckpt")
    opt.close()


@pytest.mark.parametrize("reentrant,where", [(False, "cpu"), (True, "cpu"), (False, "nvme")])
def test_parameter_offload_under_activation_checkpointing(tmp_path, reentrant, where):
    """torch.utils.checkpoint recomputes each block's forward inside backward: the blocks
    use their parameters again there, and the training is the plain engine's, bit for bit,
    whether each use fetches them again (no reuse) or, from the second step, modules keep
    them between uses (stage3_max_reuse_distance, within stage3_max_live_parameters): then
    each of the 11 modules copies once a step. The same with the parameters on NVMe (a host
    cache of 400 of the 1889 values)."""
    import torch.utils.checkpoint as cp

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.n, self.b = (torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                                      torch.nn.Linear(16, 16))

        def forward(self, x):
            return x + self.b(torch.tanh(self.n(self.a(x))))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e, self.o = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            h = self.e(x)
            for b in self.blocks:
                h = cp.checkpoint(b, h, use_reentrant=reentrant)
            return self.o(h)

    def run(offload, **reuse):
        torch.manual_seed(0)
        model = Model()
        zero = {"stage": 3 if offload else 2, "offload_optimizer": {"device": "cpu"},
                "stage3_param_persistence_threshold": 0, **reuse}
        if offload:
            zero["offload_param"] = {"device": "cpu"}
            if where == "nvme":
                nvme = tmp_path / str(len(list(tmp_path.iterdir())))  # one per run (its lock)
                nvme.mkdir()
                zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme),
                                         "max_in_cpu": 400}
        opt = zt.OffloadOptimizer(model.named_parameters(), config={"zero_optimization": zero},
                                  lr=1e-2, model=model)
        g = torch.Generator().manual_seed(1)
        losses, fetches = [], []
        for _ in range(5):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            fetches.append(opt.stats().get("parameter_fetches"))
        params = {n: opt.parameter_values(n) for n, _ in model.named_parameters()}
        if offload:  # between steps the model holds no parameter values
            assert all(p.numel() == 0 for p in model.parameters())
        return losses, params, fetches

    want, want_params, _ = run(False)
    counts = {}
    for label, reuse in (("none", {"stage3_max_reuse_distance": 0,
                                   "stage3_max_live_parameters": 1}),
                         ("adjacent", {"stage3_max_reuse_distance": 0}),
                         ("default", {})):
        got, got_params, counts[label] = run(True, **reuse)
        assert got == want, label
        for name, values in want_params.items():
            assert torch.equal(got_params[name], values), (label, name)
    # Without reuse: each module's forward, then the blocks' recomputed forward and every
    # backward (31 uses; a block whose backward starts its recomputation uses its parameters
    # there without a copy of their own). With reuse, from step 2: once per module.
    assert counts["none"] == [counts["none"][0]] * 5 and counts["none"][0] >= 28, counts
    assert counts["default"] == [counts["none"][0]] + [11] * 4, counts
    # Distance 0 keeps only modules used again right away (the output layer from its forward
    # to its backward).
    assert counts["adjacent"][0] == counts["none"][0], counts
    assert 11 < counts["adjacent"][1] < counts["none"][0], counts


@pytest.mark.parametrize("where", ["cpu", "nvme", "state-nvme"])
def test_parameter_offload_trains_a_transformers_llama_as_the_engine(tmp_path, where):
    """The 7B example's path on a tiny Llama: transformers' gradient checkpointing, stage 3 with
    offload_param (host memory, or NVMe behind a cache of 10000 of its 95k values; or host
    memory with half the optimizer state on NVMe), the same losses and parameters as the plain
    engine."""
    transformers = pytest.importorskip("transformers")

    def run(offload):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=101, max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(config)
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        model.train()
        zero = {"stage": 3 if offload else 2, "offload_optimizer": {"device": "cpu"}}
        if offload:
            zero["offload_param"] = {"device": "cpu"}
            if where == "nvme":
                nvme = tmp_path / str(len(list(tmp_path.iterdir())))  # one per run (its lock)
                nvme.mkdir()
                zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme),
                                         "max_in_cpu": 10000}
            if where == "state-nvme":  # half the optimizer state on NVMe (the 13B+ path)
                zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path),
                                             "ratio": 0.5}
        opt = zt.OffloadOptimizer(model.named_parameters(), config={"zero_optimization": zero},
                                  lr=1e-3, model=model)
        tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
        losses = []
        for _ in range(4):
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, {n: opt.parameter_values(n) for n, _ in model.named_parameters()}

    (want, want_params), (got, got_params) = run(False), run(True)
    assert got == want and got[-1] < got[0]
    for name, values in want_params.items():
        assert torch.equal(got_params[name], values), name


def test_a_rank_that_dies_is_a_clear_error_not_a_hang(tmp_path):
    """Rank 2 of 3 exits in step 3; ranks 0 and 1 raise a zoffload error naming it (or saying
    another rank gave up) within zoffload.comm_timeout_seconds (2 s here), never hang."""
    port = free_port()
    procs = []
    start = time.monotonic()
    for rank in range(3):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), ZERO_TEST_DIE_AT_STEP="3")
        procs.append(subprocess.Popen([sys.executable, WORKER, str(tmp_path / "dead"), "2", "1"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [3, 3, 0], outputs
    for out in outputs[:2]:
        assert "rank(s) 2 did not reach barrier" in out or "another rank gave up" in out, out
    assert time.monotonic() - start < 90
