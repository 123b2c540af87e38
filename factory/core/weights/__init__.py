"""Versioned weight publication: lossless full and delta encodings, and the transports that carry them.

What it owns: numbering versions, encoding them (`codec.py`) from host snapshots in buffers kept between
versions (`staging.py`: pinned from a GPU, one sync per version, tied tensors once), publishing them to subscribers over
one of three media behind the `Transport` interface (`transport.py`: in-process, shared directory;
`dist.py`: torch.distributed broadcast), and failing loudly: every blocking call takes a timeout and
raises `WeightSyncTimeout` saying who waited on what. It knows nothing of models, trainers or loops:
it moves `dict[str, Tensor]` between versions. `shared.py` is the one medium without an encoding: a double-buffered
flat buffer (host shared memory, or a GPU's memory mapped by CUDA IPC) that a reader maps once and copies each
version from, a seqlock per slot keeping versions whole (`SharedWeightsWriter`, `SharedWeightsReader`).

    pub = WeightPublisher(SharedDirTransport("/dev/shm/run1/weights"))      # trainer side
    pub.publish(model.state_dict(), version=step)
    sub = WeightSubscriber(SharedDirTransport("/dev/shm/run1/weights"), "rollout-0",
                           state=engine_model.state_dict(), version=0)        # engine side
    sub.poll(timeout=60)   # newest version, written into the engine's tensors in place

Encodings. `full`: every tensor's raw bytes. `delta`: per tensor, against the previous version,
on the raw bits (so reconstruction is bit-exact for any dtype, NaN payloads and -0.0 included):
unchanged -> nothing; < 50% of elements changed -> `sparse`: the gaps between changed elements and
zigzag(new - old) of their bit patterns (unsigned, wrapping), each split into byte planes and
compressed with zstd level 1; otherwise `dense`: zigzag(new - old) for all elements, same coding.
Every tensor carries the sha256 of its new bytes; apply checks it, and a delta names its base
version, which apply checks too. The JSON header is zstd-compressed.

Why this scheme: zigzag(new - old) makes a one-ulp step +-1 (XOR gives 1, 3, 7, ...); sparse coding beats
dense while few elements change and loses above about half, hence the 50% switch; zstd level 1 is as
small as higher levels on these streams and the fastest; numpy, zstd and hashlib release the GIL, so
tensors are coded on `WORKERS` threads. The comparisons behind each choice, and what
`benchmarks/weight_sync.py` measures end to end, are in docs/results.md ("Weight sync").
"""

from factory.core.weights.codec import (
    TensorPayload,
    WeightChecksumError,
    WeightSyncError,
    WeightSyncTimeout,
    WeightUpdate,
    WeightVersionMismatch,
    apply_update,
    encode_delta,
    encode_full,
    state_layout_digest,
    tensor_checksum,
)
from factory.core.weights.dist import TorchDistTransport
from factory.core.weights.transport import (
    InProcessTransport,
    SharedDirTransport,
    Transport,
    WeightPublisher,
    WeightSubscriber,
)

__all__ = [
    "InProcessTransport",
    "SharedDirTransport",
    "TensorPayload",
    "TorchDistTransport",
    "Transport",
    "WeightChecksumError",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightSyncError",
    "WeightSyncTimeout",
    "WeightUpdate",
    "WeightVersionMismatch",
    "apply_update",
    "encode_delta",
    "encode_full",
    "state_layout_digest",
    "tensor_checksum",
]
