"""CPU+GPU Hogbatch (Ma and Rusu, arXiv 2004.08771): every rank updates one central model asynchronously, each
with its own batch size (a GPU rank with large batches beside CPU ranks with small ones). Their code
(YMA33/CPU-GPU-SGD) runs lock-free Hogwild CPU threads on a shared model that the GPU copies and overwrites; MPI
ranks share no memory, so here the shared model is the server's z and every update is applied to it in turn.

It is Omnivore with one group per rank (G = P). A rank's step, at the server, applied to whatever z is then:

    g_r = (1 / k) Σ_j ∇ℓ(w_j) on its batches of b_r samples       (w_j = z as rank r last read it)
    u ← μ u + s_r (g_r + λ z);  z ← z − η u                        (μ = 0: the paper's plain step)

s_r = 1, the constant step of CPU+GPU Hogbatch's code; with `--batch-scaled-lr`, s_r = b_r / B, HeteroGPU's step
η·b_i/B (B: `--base-batch`, by default the mean starting batch), which it pairs with the adaptive batch sizes below.

Within a round each rank takes the next batch as soon as it is free, so a faster rank makes more updates. Each
evaluation record carries every rank's update count and the staleness histogram. With `--adaptive-batch`
(Adaptive Hogbatch), after every window of `--adapt-every` rounds rank i's share of the updates p_i moves its
batch size toward balanced update counts: b_i grows when p_i > 1/P and shrinks when p_i < 1/P (HeteroGPU's
rule, crossbow_mpi.control.adaptive_batch; the Adaptive Hogbatch code is not released).
"""

from crossbow_mpi.algorithms.omnivore import Omnivore


class Hogbatch(Omnivore):
    name = "hogbatch"

    def begin_round(self, offset: int, end: int, limit: int, learners: int, batch_sizes: tuple[int, ...]) -> int | None:
        if self.hp.batch_scaled_lr:
            self.step_scale = batch_sizes[self.transport.data.rank] / self.hp.base_batch
        return super().begin_round(offset, end, limit, learners, batch_sizes)
