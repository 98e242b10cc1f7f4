import pytest
import torch
from torch import nn

from crossbow_mpi.models import MLP, CifarResNet, LeNet, build_model, model_names


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def count_modules(model: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for m in model.modules())


@pytest.mark.parametrize(
    "name, input_shape",
    [
        ("lenet", (1, 28, 28)),
        ("lenet", (3, 32, 32)),
        ("mlp", (1, 28, 28)),
        ("mlp", (20,)),
        ("resnet32", (3, 32, 32)),
        ("resnet32", (1, 28, 28)),
    ],
)
def test_output_shape(name, input_shape):
    torch.manual_seed(0)
    model = build_model(name, input_shape, num_classes=7)
    assert model(torch.randn(2, *input_shape)).shape == (2, 7)


def test_lenet_matches_crossbow():
    model = build_model("lenet", (1, 28, 28), 10)
    assert isinstance(model, LeNet)
    layers = (model.conv1, model.conv2, model.fc1, model.fc2)
    assert [num_params(layer) for layer in layers] == [520, 25050, 400500, 5010]
    assert num_params(model) == 431080
    assert model.fc1.in_features == 800


def test_lenet_rejects_small_or_non_square_inputs():
    with pytest.raises(ValueError):
        LeNet(1, 12, 10)
    with pytest.raises(ValueError):
        build_model("lenet", (1, 28, 32), 10)
    with pytest.raises(ValueError):
        build_model("lenet", (784,), 10)


def test_resnet32_structure():
    model = build_model("resnet32", (3, 32, 32), 10)
    assert isinstance(model, CifarResNet)
    assert count_modules(model, nn.Conv2d) == 31
    assert count_modules(model, nn.Linear) == 1
    assert count_modules(model, nn.BatchNorm2d) == 31
    assert num_params(model) == 464154  # option-A shortcuts add no parameters


def test_mlp_hidden_layers():
    assert num_params(build_model("mlp", (1, 28, 28), 10)) == 784 * 256 + 256 + 256 * 10 + 10
    model = MLP(12, 3, hidden_dims=(8, 4))
    assert [m.out_features for m in model.modules() if isinstance(m, nn.Linear)] == [8, 4, 3]
    assert count_modules(MLP(12, 3, hidden_dims=()), nn.Linear) == 1


@pytest.mark.parametrize("name, input_shape", [("lenet", (1, 28, 28)), ("mlp", (1, 28, 28)), ("resnet32", (3, 32, 32))])
def test_deterministic_init_and_no_dropout(name, input_shape):
    torch.manual_seed(1)
    a = build_model(name, input_shape, 10)
    torch.manual_seed(1)
    b = build_model(name, input_shape, 10)
    for (key, value_a), value_b in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(value_a, value_b), key
    assert not any(isinstance(m, nn.modules.dropout._DropoutNd) for m in a.modules())


def test_attention_takes_sequences_of_any_length_and_refuses_images():
    model = build_model("attention", (64,), 10)
    for length in (8, 64):
        assert model(torch.randint(32, (4, length)).float()).shape == (4, 10)
    with pytest.raises(ValueError, match="needs token sequences"):
        build_model("attention", (1, 28, 28), 10)


def test_attention_is_sized_by_model_args():
    wide = build_model("attention", (64,), 10, "width=64,heads=8")
    assert wide.embed.embedding_dim == 64 and wide.attend.num_heads == 8
    assert wide(torch.randint(32, (2, 16)).float()).shape == (2, 10)
    with pytest.raises(ValueError, match="the width 30 is not divisible by the 4 heads"):
        build_model("attention", (64,), 10, "width=30")


def test_unknown_model():
    assert model_names() == ["attention", "lenet", "mlp", "resnet32", "tinygpt"]
    with pytest.raises(ValueError) as excinfo:
        build_model("vgg", (3, 32, 32), 10)
    message = str(excinfo.value)
    assert "\n" not in message and "'vgg'" in message
    assert all(name in message for name in model_names())
