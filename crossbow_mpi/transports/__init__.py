"""The algorithms' own transports over a communicator: eager-SGD's partial allreduce and Omnivore's model server."""

from crossbow_mpi.comm import Communicator

__all__ = ["build_transport"]


def build_transport(kind: str, data: Communicator, config, group: Communicator | None = None) -> Communicator:
    """Return what an algorithm reduces over (collective): the data scope's communicator for `allreduce`,
    eager-SGD's partial collective over it for `partial`, or for `server` the compute `group`'s collectives with
    Omnivore's model server over the data scope."""
    if kind == "server":
        from crossbow_mpi.transports.model_server import ModelServer

        assert group is not None, "the model server serves compute groups"
        return ModelServer(data, group, data.size // group.size)
    if kind == "partial":
        from crossbow_mpi.transports.partial_allreduce import PartialAllreduce

        return PartialAllreduce(data, config.eager_mode, config.eager_sync_every, config.seed)
    assert kind == "allreduce", kind
    return data
