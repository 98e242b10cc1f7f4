"""Pipeline parallelism: a model split into stages, and the stages run over the ranks of a stage scope."""
