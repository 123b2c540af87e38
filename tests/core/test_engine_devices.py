"""Both embedded engines compute on their model's device: the same tokens as before on the CPU, and on a GPU every
tensor they make asks for the model's device.

No GPU here, so the routing tests tell the engines their model is on cuda:0 (the device lookup is patched) and
record, through a TorchFunctionMode, the device each tensor factory call of the engines' own code asks for; the
calls are then served on the CPU, so the whole decode loop runs for real. A factory call from the engine without
the model's device (a CPU default) fails the test; transformers' own calls inside the model are not the engines'
and are not judged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import factory.core.rollout.engines.continuous as continuous_mod
import factory.core.rollout.engines.embedded as embedded_mod
from factory.core.evaluate import evaluate
from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.engines.embedded import EmbeddedEngine, decode_autocast
from factory.infra.device import model_device
from factory.problem import Problem
from tests.core.engine_cases import GOLDEN, PROMPTS, all_cases, continuous_params, sharp_model

FAKE = torch.device("cuda", 0)
ROLLOUT_DIR = str(Path(embedded_mod.__file__).parent)
TORCH_DIR = str(Path(torch.__file__).parent)
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.numpy}
FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.full, torch.arange, torch.empty, torch.eye, torch.rand,
             torch.randn, torch.randint, torch.linspace, torch.as_tensor}


def _caller() -> str:
    """The file of the first frame outside torch and this module: whose code made the call."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH_DIR)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""


class DeviceRecorder(TorchFunctionMode):
    """Records the device every tensor factory call of the rollout engines' code asks for, and serves a call that
    asks for FAKE on the CPU (the real device here). What the engines make for FAKE, and what their code derives
    from it, is tagged: their code reads `.device` of a tagged tensor as FAKE, so following a tensor's device is
    judged like naming it; transformers' code inside the model sees plain CPU tensors."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str, torch.device | None]] = []  # (function, caller file, device asked for)
        self._tagged: dict[int, torch.Tensor] = {}  # id -> tensor (held, so that ids stay unique)
        self.reads: list[tuple[str, torch.Size]] = []  # the engines' reads of device tensors on the host (waits)
        self.events: list[str] = []  # factory calls, reads and model forwards, in order

    def tagged(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and self._tagged.get(id(t)) is t

    def _tag(self, out: object) -> object:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._tagged[id(t)] = t
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        caller = _caller()
        ours = caller.startswith(ROLLOUT_DIR)
        if getattr(func, "__self__", None) is torch._C.TensorBase.device and ours and self.tagged(args[0]):
            return FAKE
        if func in FACTORIES and ours:
            device = kwargs.get("device")
            device = None if device is None else torch.device(device)
            self.calls.append((func.__name__, caller, device))
            self.events.append(func.__name__)
            if device == FAKE:
                kwargs["device"] = "cpu"
                return self._tag(func(*args, **kwargs))
            return func(*args, **kwargs)
        if ours and func in HOST_READS and self.tagged(args[0]):
            self.reads.append((func.__name__, args[0].shape))
            self.events.append(func.__name__)
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):  # a host copy (here the tensor itself: `.cpu()` of a CPU tensor)
                self._tagged.pop(id(out), None)
            return out
        if func is torch.Tensor.to:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, (str, torch.device)) and torch.device(target) == FAKE:
                return self._tag(args[0])
        out = func(*args, **kwargs)
        flat = [x for a in (*args, *kwargs.values()) for x in (a if isinstance(a, (tuple, list)) else (a,))]
        if ours and any(self.tagged(x) for x in flat):
            self._tag(out)
        return out

    def off_device(self) -> list[tuple[str, str, torch.device | None]]:
        return [c for c in self.calls if c[2] != FAKE]

    def watch_inputs(self, model: torch.nn.Module) -> list[str]:
        """Wrap `model.forward`: the names of tensor arguments the engine passes that are not on FAKE."""
        forward, strays = model.forward, []

        def checked(*args, **kwargs):
            self.events.append("forward")
            strays.extend(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and not self.tagged(v))
            strays.extend("positional" for a in args if isinstance(a, torch.Tensor) and not self.tagged(a))
            return forward(*args, **kwargs)

        model.forward = checked
        return strays


@pytest.fixture
def on_fake_gpu(monkeypatch):
    """The engines believe their model is on cuda:0; generators asked for there are CPU ones, and recorded."""
    generators: list[torch.device] = []
    real = torch.Generator

    def generator(device="cpu"):
        generators.append(torch.device(device))
        return real(device="cpu")

    monkeypatch.setattr(embedded_mod, "model_device", lambda model: FAKE)
    monkeypatch.setattr(continuous_mod, "model_device", lambda model: FAKE)
    monkeypatch.setattr(torch, "Generator", generator)
    return generators


# ------------------------------------------------------------------------------------------------ CPU: unchanged
def test_cpu_tokens_and_logprobs_equal_those_recorded_on_main():
    """Greedy, sampled and top-p completions of both engines (sdpa and eager attention, requests joining while
    others decode) are those main's engines gave before they knew about devices: the same tokens, logprobs to 1e-5."""
    torch.set_num_threads(1)
    golden = json.loads(GOLDEN.read_text())
    now = json.loads(json.dumps(all_cases()))  # tuples to lists, as recorded
    assert now.keys() == golden.keys()
    for name in golden:
        assert _tokens_exact_floats_close(now[name], golden[name]), name


def _tokens_exact_floats_close(now: object, golden: object) -> bool:
    """Tokens, lengths and finish reasons equal; float32 logprobs within 1e-5, because another CPU's BLAS kernels
    (the CI machine's against the recording one's) sum in another order and move the last bits."""
    if isinstance(golden, float):
        return isinstance(now, float) and now == pytest.approx(golden, rel=1e-5, abs=1e-5)
    if isinstance(golden, dict):
        return isinstance(now, dict) and now.keys() == golden.keys() and all(
            _tokens_exact_floats_close(now[k], golden[k]) for k in golden)
    if isinstance(golden, list):
        return isinstance(now, list) and len(now) == len(golden) and all(
            _tokens_exact_floats_close(a, b) for a, b in zip(now, golden, strict=True))
    return now == golden


def test_model_device_and_cpu_autocast_stays_fp32():
    model, _ = sharp_model()
    assert model_device(model) == torch.device("cpu")
    assert model_device(torch.nn.Module()) == torch.device("cpu")  # no parameters: the CPU
    with decode_autocast(torch.device("cpu"), "bf16"):  # a bf16 run's rollouts stay fp32 on the CPU
        assert model(torch.tensor([[1, 2, 3]])).logits.dtype == torch.float32
    ctx = decode_autocast(FAKE, "bf16")  # on a GPU: bf16 autocast (constructed only: no CUDA here)
    assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16 and ctx.device == "cuda"
    assert not isinstance(decode_autocast(FAKE, "fp32"), torch.autocast)


# ------------------------------------------------------------------------------------------------ GPU routing
def test_embedded_engine_makes_every_tensor_on_the_models_device(on_fake_gpu):
    model, tok = sharp_model()
    on_fake_gpu.clear()  # sharp_model's own
    eng = EmbeddedEngine(model, tok, max_batch=4)
    rec = DeviceRecorder()
    strays = rec.watch_inputs(model)
    with rec:
        greedy = eng.generate(eng.encode(PROMPTS), SamplingParams(greedy=True, max_new_tokens=6))
        sampled = eng.generate(eng.encode(PROMPTS), SamplingParams(n=2, temperature=0.9, top_p=0.8,
                                                                   max_new_tokens=6, seed=3))
    assert len(rec.calls) >= 8 and not rec.off_device(), rec.off_device()
    assert not strays, strays  # ids, mask and positions reach the model on its device
    # a decode step waits on the device once (is every row done?); the results come back in one copy each
    assert {name for name, _ in rec.reads} == {"__bool__", "cpu"}
    assert sum(name == "cpu" for name, _ in rec.reads) == 3 * (2 + 3)  # tokens, logprobs, lengths per batch of 4
    assert on_fake_gpu == [FAKE, FAKE]  # one generator per generate call, on the model's device
    # results come back as host lists, whatever the device
    c = sampled[0][0]
    assert isinstance(c.token_ids, list) and all(isinstance(t, int) for t in c.token_ids)
    assert isinstance(c.logprobs, list) and all(isinstance(x, float) for x in c.logprobs)
    assert len(greedy) == len(PROMPTS) and all(len(g) == 2 for g in sampled)


def test_continuous_engine_makes_every_tensor_on_the_models_device(on_fake_gpu):
    """Prefill, decode, cache growth and compaction, top-p and top-logprobs, sdpa and eager masks."""
    for attn in ("sdpa", "eager"):
        model, tok = sharp_model(attn=attn)
        on_fake_gpu.remove(torch.device("cpu"))  # sharp_model's own
        eng = ContinuousEngine(model, tok, max_batch=3, kv_capacity=8)
        rec = DeviceRecorder()
        strays = rec.watch_inputs(model)
        with rec:
            futures = []
            for i, (prompt, params) in enumerate(zip(PROMPTS, continuous_params(), strict=True)):
                futures.append(eng.submit(tok(prompt).input_ids, params, sample_index=i))
                eng.step()
            while not all(f.done() for f in futures):
                assert eng.step()
        comps = [f.result() for f in futures]
        assert eng.stats.steps > 5 and eng.stats.prefills > 1
        assert {c.finish_reason for c in comps} == {"stop", "length"}
        assert len(rec.calls) > 20 and not rec.off_device(), rec.off_device()
        assert not strays, strays
        # one read of the device per forward (the sampled tokens with their logprobs), nothing else
        assert [name for name, _ in rec.reads] == ["tolist"] * (eng.stats.steps + eng.stats.prefills)
        assert eng._cache.device == torch.device("cpu")  # served on the CPU here, as the recorder redirected
        assert comps[1].top_logprobs and all(isinstance(t, int) for t, _ in comps[1].top_logprobs[0])
    assert len(on_fake_gpu) == 2 * len(PROMPTS) and set(on_fake_gpu) == {FAKE}  # one per request


def test_continuous_decode_step_copies_to_and_from_the_device_once(on_fake_gpu):
    """A decode step copies its inputs to the device before the forward is queued (so the copies do not wait for
    it) and reads the device once, after it."""
    model, tok = sharp_model()
    eng = ContinuousEngine(model, tok, max_batch=4)
    for i, prompt in enumerate(PROMPTS[:4]):
        eng.submit(tok(prompt).input_ids, SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=8,
                                                         ignore_eos=True, top_logprobs=2, seed=i))
    with DeviceRecorder():
        eng.step()  # the prefill (and a first decode step)
    rec = DeviceRecorder()
    strays = rec.watch_inputs(model)
    with rec:
        eng._decode()
    uploads = [c for c in rec.calls if c[0] == "tensor"]
    assert len(uploads) == 2, rec.calls  # the step's inputs, and the rows' sampling knobs
    assert rec.events.count("forward") == 1 and not strays
    forward = rec.events.index("forward")
    assert "tensor" not in rec.events[forward:] and rec.events[-1] == "tolist", rec.events
    assert rec.reads == [("tolist", torch.Size([4, 2 + 2 * 2]))]  # token, logprob, 2 ids, 2 logprobs per row


def test_evaluate_runs_on_the_models_device(on_fake_gpu):
    model, tok = sharp_model()
    on_fake_gpu.clear()  # sharp_model's own
    problems = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer=str(2 * i), op="add", digits=1) for i in range(6)]
    rec = DeviceRecorder()
    strays = rec.watch_inputs(model)
    with rec:
        res = evaluate(EmbeddedEngine(model, tok), tok, problems, max_new_tokens=4, k=2, seed=1)
    assert res.n == 6 and res.pass_at_k is not None
    assert rec.calls and not rec.off_device(), rec.off_device()
    assert not strays, strays
    assert on_fake_gpu == [FAKE, FAKE]  # greedy and pass@k sampling
