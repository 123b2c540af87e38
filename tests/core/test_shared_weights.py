"""The shared-buffer weight handoff (`factory/core/weights/shared.py`) on CPU shared memory, reader in a real process
(spawn): versions in order, never half-written, a reader that fell behind gets the newest; ties once; bad handles."""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import re
import traceback

import pytest
import torch

from factory.core.weights import WeightSyncError
from factory.core.weights.shared import SharedHandleError, SharedWeightsReader, SharedWeightsWriter

WAIT = 60.0
# the CUDA IPC path runs where a GPU is at hand (the reader process maps the writer's device buffers)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
SHAPES = {"embed.weight": (64, 32), "layer.weight": (32, 32), "layer.bias": (32,), "norm.weight": (32,)}


def make_state(version: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """Version `version`'s tensors: tensor k filled with version * 16 + k (exact in fp32); the head tied to the
    embedding. `scale` multiplies every shape's first dimension (a bigger, slower copy)."""
    state = {name: torch.full((shape[0] * scale, *shape[1:]), float(version * 16 + k))
             for k, (name, shape) in enumerate(SHAPES.items())}
    state["head.weight"] = state["embed.weight"]
    return state


def whole(state: dict[str, torch.Tensor], version: int) -> bool:
    """Whether every tensor of `state` holds version `version`'s pattern, every element of it."""
    return all(bool((state[name] == version * 16 + k).all()) for k, name in enumerate(SHAPES)) \
        and bool((state["head.weight"] == version * 16).all())


def empty_state(dtype: torch.dtype = torch.float32, scale: int = 1, device: str = "cpu") -> dict[str, torch.Tensor]:
    state = {k: torch.full_like(v, -1.0, dtype=dtype, device=device) for k, v in make_state(0, scale).items()}
    state["head.weight"] = state["embed.weight"]
    return state


class PausingReader(SharedWeightsReader):
    """Stops in the middle of its first copy until told to go on (the writer publishes meanwhile)."""

    mid_copy = go_on = None

    def _copy(self, slot, state):
        if self.mid_copy is not None:
            first = dict(list(state.items())[:2])
            for e in self.entries[:2]:
                first[e.name].copy_(self.slots[slot][e.offset:e.offset + e.numel].view(e.shape))
            self.mid_copy.set()
            assert self.go_on.wait(WAIT)
            self.mid_copy = None
        super()._copy(slot, state)


def _reader(handle_json: str, scenario: str, commands, replies, events, device: str) -> None:
    try:
        torch.set_num_threads(1)
        handle = json.loads(handle_json)
        if scenario == "lockstep":
            reader = SharedWeightsReader.attach(handle)
            state = empty_state(torch.float64, device=device)  # another dtype than the buffer's: cast on the copy
            while commands.get(timeout=WAIT) != "stop":
                v = reader.read_into(state)
                replies.put(("ok", v, v is not None and whole(state, v)))
        elif scenario == "race":  # as slow as it can, against a writer as fast as it can, until the last version
            reader = SharedWeightsReader.attach(handle)
            state, seen, final = empty_state(torch.float64, 64, device), [], commands.get(timeout=WAIT)
            replies.put(("ok", None, None))  # attached
            while not seen or seen[-1][0] != final:
                v = reader.read_into(state)
                if v is not None:
                    seen.append((v, whole(state, v)))
            replies.put(("ok", seen, reader.retries))
        else:  # "lap": the writer comes round to the slot being copied
            reader = PausingReader.attach(handle)
            reader.mid_copy, reader.go_on = events
            state = empty_state(device=device)
            v = reader.read_into(state)
            replies.put(("ok", v, (whole(state, v), reader.retries)))
        reader.close()
    except BaseException:
        replies.put(("error", traceback.format_exc(), None))


@pytest.fixture
def spawn():
    ctx = mp.get_context("spawn")
    procs = []

    def start(writer: SharedWeightsWriter, scenario: str):
        commands, replies = ctx.Queue(), ctx.Queue()
        events = (ctx.Event(), ctx.Event())
        proc = ctx.Process(target=_reader, args=(json.dumps(writer.handle()), scenario, commands, replies, events,
                                                  writer.device.type))
        proc.start()
        procs.append(proc)
        return commands, replies, events

    yield start
    for proc in procs:
        proc.join(WAIT)
        if proc.is_alive():
            proc.kill()
        assert proc.exitcode == 0


def reply(replies) -> tuple:
    status, value, extra = replies.get(timeout=WAIT)
    assert status == "ok", value
    return value, extra


@pytest.mark.parametrize("device", DEVICES)
def test_versions_arrive_in_order_whole_and_a_reader_that_fell_behind_gets_the_newest(spawn, device):
    with SharedWeightsWriter.create(make_state(0), torch.bfloat16, device) as writer:  # the patterns are exact in bf16
        commands, replies, _ = spawn(writer, "lockstep")
        commands.put("read")
        assert reply(replies) == (None, False)  # nothing published yet
        for v in (1, 2, 3):
            writer.publish(make_state(v), v)
            commands.put("read")
            assert reply(replies) == (v, True)
        commands.put("read")
        assert reply(replies) == (None, False)  # nothing newer than what it read
        for v in (5, 8, 9):  # versions need not be consecutive, only increasing; the reader sleeps through them
            writer.publish(make_state(v), v)
        commands.put("read")
        assert reply(replies) == (9, True)
        commands.put("stop")


@pytest.mark.parametrize("device", DEVICES)
def test_a_reader_never_sees_a_half_written_version(spawn, device):
    """A writer publishing as fast as it can against a reader copying slowly (64x the tensors, cast to fp64,
    every element checked): each version the reader returns is whole, and they strictly increase."""
    final = 400
    with SharedWeightsWriter.create(make_state(0, scale=64), torch.float32, device) as writer:
        commands, replies, _ = spawn(writer, "race")
        commands.put(final)
        assert reply(replies)[0] is None  # attached
        state = {k: v.to(device) for k, v in make_state(0, scale=64).items()}
        state["head.weight"] = state["embed.weight"]
        for v in range(1, final + 1):
            for k, name in enumerate(SHAPES):  # in place (the head is the embedding): no allocation between publishes
                state[name].fill_(v * 16 + k)
            writer.publish(state, v)
        seen, retries = reply(replies)
    versions = [v for v, _ in seen]
    assert all(ok for _, ok in seen), [v for v, ok in seen if not ok]
    assert versions == sorted(set(versions)) and versions[-1] == final
    print(f"reads={len(seen)} retries={retries}")


@pytest.mark.parametrize("device", DEVICES)
def test_a_copy_the_writer_overtook_is_taken_again(spawn, device):
    """The reader stops halfway through copying version 1's slot; the writer publishes 2 (the other slot) and 3
    (that slot): the reader notices, copies again, and returns 3 whole."""
    with SharedWeightsWriter.create(make_state(0), torch.float32, device) as writer:
        writer.publish(make_state(1), 1)
        _, replies, (mid_copy, go_on) = spawn(writer, "lap")
        assert mid_copy.wait(WAIT)
        writer.publish(make_state(2), 2)
        writer.publish(make_state(3), 3)
        go_on.set()
        assert reply(replies) == (3, (True, 1))


def test_tied_tensors_are_written_once_and_read_into_both_names():
    state = make_state(1)
    with SharedWeightsWriter.create(state, torch.bfloat16, "cpu") as writer:
        untied = sum(t.numel() for k, t in state.items() if k != "head.weight")
        assert writer.numel == untied  # the head is not laid out twice
        assert json.loads(json.dumps(writer.handle())) == writer.handle()  # JSON, no pickle
        offsets = {t["name"]: t["offset"] for t in writer.handle()["tensors"]}
        assert offsets["head.weight"] == offsets["embed.weight"]
        assert os.path.getsize(writer.handle()["slots"][0]["path"]) == untied * 2  # bf16
        writer.publish(state, 1)
        with SharedWeightsReader.attach(writer.handle()) as reader:
            untied_dst = empty_state()
            untied_dst["head.weight"] = untied_dst["embed.weight"].clone()  # a reader may hold them apart
            assert reader.read_into(untied_dst) == 1 and whole(untied_dst, 1)


def test_publish_refuses_an_old_version_and_a_state_of_another_layout():
    with SharedWeightsWriter.create(make_state(0), torch.float32, "cpu") as writer:
        writer.publish(make_state(4), 4)
        with pytest.raises(ValueError, match="versions strictly increase"):
            writer.publish(make_state(4), 4)
        bad = make_state(5)
        bad["layer.bias"] = torch.zeros(33)
        with pytest.raises(SharedHandleError, match=r"state\['layer.bias'\] has shape \(33,\)"):
            writer.publish(bad, 5)
        with pytest.raises(SharedHandleError, match="missing \\['norm.weight'\\]"):
            writer.publish({k: v for k, v in make_state(5).items() if k != "norm.weight"}, 5)
        with SharedWeightsReader.attach(writer.handle()) as reader:
            assert reader.read_into(empty_state()) == 4
    with pytest.raises(SharedHandleError, match=r"state\['ids'\]: the shared buffer holds floating-point"):
        SharedWeightsWriter.create({"ids": torch.arange(3)}, torch.float32, "cpu")


def test_close_removes_the_files():
    writer = SharedWeightsWriter.create(make_state(0), torch.float32, "cpu")
    handle = writer.handle()
    files = [handle["control"], *(s["path"] for s in handle["slots"])]
    assert all(os.path.isfile(f) for f in files)
    writer.close()
    assert not any(os.path.exists(f) for f in files) and not os.path.exists(os.path.dirname(handle["control"]))
    with pytest.raises(SharedHandleError, match="field 'control': cannot open"):
        SharedWeightsReader.attach(handle)


def _set(path: list, value):
    def edit(h: dict) -> None:
        node = h
        for key in path[:-1]:
            node = node[key]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return edit


@pytest.mark.parametrize(("edit", "field"), [
    (_set(["kind"], "other"), "'kind'"),
    (_set(["format"], 2), "'format'"),
    (_set(["id"], KeyError), "'id' is missing"),
    (_set(["id"], True), "'id': expected int"),
    (_set(["device"], "tpu"), "'device'"),
    (_set(["dtype"], "int8"), "'dtype'"),
    (_set(["numel"], 0), "'numel': expected an integer >= 1"),
    (_set(["numel"], "many"), "'numel': expected int"),
    (_set(["slots"], []), "'slots': expected 2 slots"),
    (_set(["slots", 1, "path"], "/etc/passwd"), "'slots[1].path'"),
    (_set(["slots", 0, "path"], "/dev/null"), "'slots[0].path': '/dev/null' is not a regular file"),
    (_set(["control"], 7), "'control': expected str"),
    (_set(["tensors"], []), "'tensors': no tensors"),
    (_set(["tensors", 0], "x"), "'tensors[0]'"),
    (_set(["tensors", 1, "name"], "embed.weight"), "'tensors[1].name': 'embed.weight' appears twice"),
    (_set(["tensors", 2, "shape"], [-1]), "'tensors[2].shape'"),
    (_set(["tensors", 2, "dtype"], "complex"), "'tensors[2].dtype'"),
    (_set(["tensors", 3, "offset"], 10**9), "'tensors[3].offset'"),
    (_set(["tensors", 3, "offset"], KeyError), "'tensors[3].offset' is missing"),
])
def test_a_bad_handle_is_refused_naming_the_field(edit, field):
    with SharedWeightsWriter.create(make_state(0), torch.float32, "cpu") as writer:
        handle = copy.deepcopy(writer.handle())
        edit(handle)
        with pytest.raises(SharedHandleError, match="shared weights handle: field " + re.escape(field)):
            SharedWeightsReader.attach(handle)


def test_a_handle_to_another_writers_control_block_is_refused():
    with SharedWeightsWriter.create(make_state(0), torch.float32, "cpu") as a, \
            SharedWeightsWriter.create(make_state(0), torch.float32, "cpu") as b:
        handle = {**a.handle(), "control": b.handle()["control"]}
        with pytest.raises(SharedHandleError, match="field 'control': .* is not the control block of shared "
                                                    f"weights {a.layout_id}"):
            SharedWeightsReader.attach(handle)


def test_read_into_a_state_of_another_shape_names_the_tensor():
    with SharedWeightsWriter.create(make_state(0), torch.float32, "cpu") as writer:
        writer.publish(make_state(1), 1)
        with SharedWeightsReader.attach(writer.handle()) as reader:
            state = empty_state()
            state["norm.weight"] = torch.zeros(31)
            with pytest.raises(SharedHandleError, match=r"read_into: state\['norm.weight'\] has shape \(31,\)"):
                reader.read_into(state)
            assert reader.version is None  # nothing was read


def test_a_long_value_in_a_handle_is_quoted_short():
    with SharedWeightsWriter.create(make_state(0), torch.float32, "cpu") as writer:
        for field in ("kind", "control", "dtype"):
            handle = {**writer.handle(), field: "x" * 10_000}
            with pytest.raises(SharedHandleError, match=f"field '{field}'") as e:
                SharedWeightsReader.attach(handle)
            assert len(str(e.value)) < 300


def test_a_cuda_handle_is_checked_field_by_field_before_cuda_is_asked():
    """The CUDA IPC arguments of a slot (JSON, as `SharedWeightsWriter.handle()` writes them on a GPU) are checked
    before any is handed to CUDA; a whole, well-formed one for a GPU this process does not see is refused naming its
    device."""
    with SharedWeightsWriter.create(make_state(0), torch.float32, "cpu") as writer:
        n = writer.numel
        ipc = {"size": [n], "stride": [1], "offset": 0, "device_uuid": "GPU-00000000-0000-0000-0000-000000000000",
               "handle": "AAAA", "storage_size_bytes": 4 * n, "storage_offset_bytes": 0, "ref_counter_handle": "AAAA",
               "ref_counter_offset": 0, "event_handle": None, "event_sync_required": False}
        cases = [({k: v for k, v in ipc.items() if k != "event_handle"}, "'slots[0].event_handle' is missing"),
                 ({**ipc, "size": [n + 1]}, f"'slots[0].size': expected [{n}]"),
                 ({**ipc, "stride": [2]}, "'slots[0].stride'"),
                 ({**ipc, "storage_size_bytes": 4 * n - 1}, "'slots[0].storage_size_bytes'"),
                 ({**ipc, "offset": -1}, "'slots[0].offset': expected an integer >= 0"),
                 ({**ipc, "event_sync_required": "yes"}, "'slots[0].event_sync_required': expected bool"),
                 (ipc, r"'slots\[0\]\.device_uuid': (the buffers are on a GPU and this process sees none|no visible "
                       "GPU has UUID)")]
        for slot, message in cases:
            handle = {**writer.handle(), "device": "cuda", "slots": [slot, slot]}
            with pytest.raises(SharedHandleError, match=re.escape(message) if "(" not in message else message):
                SharedWeightsReader.attach(handle)


def test_a_writer_never_closed_still_removes_its_files_and_one_too_big_for_shm_is_refused():
    import gc

    writer = SharedWeightsWriter.create(make_state(0), torch.float32, "cpu")
    control = writer.handle()["control"]
    del writer
    gc.collect()
    assert not os.path.exists(control) and not os.path.exists(os.path.dirname(control))
    huge = {"w": torch.zeros(1).expand(1 << 40)}  # 4 TiB of fp32 in name only: nothing is allocated
    with pytest.raises(WeightSyncError, match=r"the shared weights buffer needs \d+ MiB in .*, \d+ MiB are free"):
        SharedWeightsWriter.create(huge, torch.float32, "cpu")


def test_a_publish_that_fails_midway_leaves_the_newest_whole_version_readable():
    with SharedWeightsWriter.create(make_state(0), torch.float32, "cpu") as writer, \
            SharedWeightsReader.attach(writer.handle()) as reader:
        writer.publish(make_state(1), 1)
        broken = make_state(2)
        broken["norm.weight"] = torch.empty(SHAPES["norm.weight"], device="meta")  # its copy fails, after others
        with pytest.raises(NotImplementedError):
            writer.publish(broken, 2)
        state = empty_state()
        assert reader.read_into(state) == 1 and whole(state, 1)
        writer.publish(make_state(2), 2)  # into the slot the failed one left holding nothing: whole again
        assert reader.read_into(state) == 2 and whole(state, 2)
        writer.publish(make_state(3), 3)
        assert reader.read_into(state) == 3 and whole(state, 3)


def test_empty_tensors_take_no_room_and_do_not_hide_a_neighbour():
    state = {"a": torch.full((3,), 1.0), "empty": torch.zeros(0), "b": torch.full((2,), 2.0)}
    with SharedWeightsWriter.create(state, torch.float32, "cpu") as writer, \
            SharedWeightsReader.attach(writer.handle()) as reader:
        writer.publish(state, 1)
        out = {k: torch.full_like(v, -1.0) for k, v in state.items()}
        assert reader.read_into(out) == 1
        assert all(torch.equal(out[k], state[k]) for k in state)
