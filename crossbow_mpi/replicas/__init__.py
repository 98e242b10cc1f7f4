"""The k learners of a rank: flat buffers, the learners and z, the engines that step them, fused kernels, the
loop's state."""
