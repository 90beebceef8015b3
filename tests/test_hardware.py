"""GPU catalog and inventory schema (tier 1)."""

from __future__ import annotations

import pytest

from megatron_hetero.errors import SchemaError
from megatron_hetero.hardware import inventory_from_data, load_catalog, load_inventory

REQUIRED = ["H100-SXM-80GB", "H800-80GB", "H20-96GB", "A100-SXM-80GB", "A100-SXM-40GB", "A800-80GB",
            "A40-48GB", "A10-24GB", "L40S-48GB", "L4-24GB", "V100-SXM2-32GB", "V100-PCIE-16GB",
            "T4-16GB", "RTX4090-24GB", "RTX3090-24GB", "MI250X-128GB", "MI300X-192GB",
            "Ascend910B-64GB", "H200-SXM-141GB", "A100-PCIe-40GB", "A100-PCIe-80GB",
            "H100-PCIe-80GB", "H100-NVL-94GB", "L40-48GB", "RTX-A6000-48GB", "RTX6000-Ada-48GB",
            "B200-180GB", "MI325X-256GB"]


def test_catalog_has_required_models_with_consistent_figures():
    catalog = load_catalog()
    for name in REQUIRED:
        spec = catalog.get(name)
        assert spec.name == name
        # The memory figure is the one the name advertises.
        assert spec.memory_gb == int(name.rsplit("-", 1)[1].removesuffix("GB"))
        # Tensor-core rate above the plain fp32 rate on every card in the list.
        assert spec.bf16_tflops > spec.fp32_tflops
        assert 0 < spec.efficiency <= 1


@pytest.mark.parametrize("reported,canonical", [
    ("NVIDIA A100-SXM4-80GB", "A100-SXM-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-SXM-40GB"),
    ("NVIDIA H100 80GB HBM3", "H100-SXM-80GB"),
    ("Tesla V100-SXM2-32GB", "V100-SXM2-32GB"),
    ("NVIDIA GeForce RTX 4090", "RTX4090-24GB"),
    ("AMD Instinct MI300X", "MI300X-192GB"),
    ("a100-sxm-80gb", "A100-SXM-80GB"),
    # what torch.cuda.get_device_name() reports on the PCIe and later cards
    ("NVIDIA H100 PCIe", "H100-PCIe-80GB"),
    ("NVIDIA H100 NVL", "H100-NVL-94GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-PCIe-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100-PCIe-80GB"),
    ("NVIDIA L40", "L40-48GB"),
    ("NVIDIA RTX A6000", "RTX-A6000-48GB"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX6000-Ada-48GB"),
    ("NVIDIA B200", "B200-180GB"),
    ("AMD Instinct MI325X", "MI325X-256GB"),
])
def test_aliases_resolve_device_names(reported, canonical):
    assert load_catalog().resolve(reported) == canonical


def test_aliases_are_unambiguous():
    catalog = load_catalog()
    for name in catalog.names():
        for alias in catalog.get(name).aliases:
            assert catalog.resolve(alias) == name, f"alias {alias!r} of {name} resolves elsewhere"


@pytest.mark.parametrize("short,cards", [
    ("A100-40GB", ["A100-SXM-40GB", "A100-PCIe-40GB"]),
    ("A100-80GB", ["A100-SXM-80GB", "A100-PCIe-80GB"]),
    ("H100", ["H100-SXM-80GB", "H100-PCIe-80GB", "H100-NVL-94GB"]),
])
def test_a_short_name_that_fits_two_cards_is_refused_naming_them(short, cards):
    """A short name once became the SXM card silently, giving a PCIe card NVLink's bandwidth:
    an inventory's group and its `gpus:` override both refuse it, naming every card it fits."""
    for data, path in (({"groups": [{"gpu": short, "nodes": 1, "gpus_per_node": 8}]},
                        "groups[0].gpu"),
                       ({"gpus": {short: {"efficiency": 0.5}},
                         "groups": [{"gpu": cards[0], "nodes": 1, "gpus_per_node": 8}]},
                        f"gpus.{short}")):
        with pytest.raises(SchemaError) as err:
            inventory_from_data(data, source="inv.yaml")
        message = str(err.value)
        assert message.startswith(f"inv.yaml: {path}: found '{short}'; expected the name of one card")
        assert all(card in message for card in cards), message


def test_a_name_that_fits_one_card_is_suggested():
    with pytest.raises(SchemaError, match=r"found 'A6000'; .*did you mean RTX-A6000-48GB\?"):
        load_catalog().get("A6000", source="inv.yaml", path="groups[0].gpu")


def test_minimal_inventory_needs_only_three_keys():
    inv = inventory_from_data({"groups": [
        {"gpu": "NVIDIA A100-SXM4-80GB", "nodes": 2, "gpus_per_node": 8},
        {"gpu": "V100-SXM2-32GB", "nodes": 1, "gpus_per_node": 4},
    ]})
    assert inv.gpu_counts() == {"A100-SXM-80GB": 16, "V100-SXM2-32GB": 4}
    assert inv.num_gpus == 20
    assert inv.intra_node_bandwidth(0) == load_catalog().get("A100-SXM-80GB").intra_node_bandwidth_gb_s


def test_inventory_overrides_and_custom_gpus():
    inv = inventory_from_data({
        "gpus": {
            "A100-SXM-80GB": {"efficiency": 0.61},
            "MyNPU-32GB": {"vendor": "Acme", "bf16_tflops": 200, "bf16": True, "fp32_tflops": 50,
                           "memory_gb": 32, "memory_bandwidth_gb_s": 1000, "intra_node_link": "PCIe5",
                           "intra_node_bandwidth_gb_s": 64, "efficiency": 0.4,
                           "aliases": ["Acme NPU"]},
        },
        "groups": [{"gpu": "A100-SXM-80GB", "nodes": 1, "gpus_per_node": 8},
                   {"gpu": "Acme NPU", "nodes": 1, "gpus_per_node": 8,
                    "intra_node_bandwidth_gb_s": 100, "inter_node_bandwidth_gb_s": 50}],
        "inter_group_bandwidth_gb_s": 6.25,
    })
    assert inv.spec("A100-SXM-80GB").efficiency == 0.61
    assert inv.spec("A100-SXM-80GB").bf16_tflops == 312.0  # other fields kept
    assert inv.groups[1].gpu == "MyNPU-32GB"
    assert inv.intra_node_bandwidth(1) == 100
    assert inv.inter_node_bandwidth(1) == 50
    assert load_catalog().resolve("MyNPU-32GB") is None  # the built-in catalog is untouched


@pytest.mark.parametrize("data,path,phrase", [
    ({}, "groups", "missing"),
    ({"groups": []}, "groups", "at least one group"),
    ({"groups": [{"gpu": "A100", "nodes": 1}]}, "groups[0].gpus_per_node", "missing"),
    ({"groups": [{"gpu": "K80", "nodes": 1, "gpus_per_node": 8}]}, "groups[0].gpu", "catalog"),
    ({"groups": [{"gpu": "A100", "nodes": 0, "gpus_per_node": 8}]}, "groups[0].nodes", "at least 1"),
    ({"groups": [{"gpu": "A100", "nodes": 2, "gpus_per_node": 8, "hosts": ["n1"]}]},
     "groups[0].hosts", "one per node"),
    ({"groups": [{"gpu": "A100", "nodes": 1, "gpus_per_node": 8, "gpu_count": 8}]},
     "groups[0].gpu_count", "unknown key"),
    ({"groups": [{"gpu": "A100", "nodes": 1, "gpus_per_node": 8, "host_memory_gb": 0}]},
     "groups[0].host_memory_gb", "positive host memory"),
    ({"groups": [{"gpu": "A100", "nodes": 1, "gpus_per_node": 8, "host_memory_gb": "1TB"}]},
     "groups[0].host_memory_gb", "a number"),
    ({"groups": [{"gpu": "A100", "nodes": 1, "gpus_per_node": 8,
                  "host_memory_gb": float("inf")}]}, "groups[0].host_memory_gb", "a finite number"),
    ({"groups": [{"gpu": "A100", "nodes": 1, "gpus_per_node": 8}], "gpus": {"New": {"vendor": "X"}}},
     "gpus.New.bf16_tflops", "missing"),
    ({"groups": [{"gpu": "A100", "nodes": 1, "gpus_per_node": 8}],
      "gpus": {"A100-SXM-80GB": {"efficiency": 1.5}}}, "gpus.A100-SXM-80GB.efficiency", "(0, 1]"),
])
def test_bad_inventory_names_the_field(data, path, phrase):
    with pytest.raises(SchemaError) as info:
        inventory_from_data(data, source="inv.yaml")
    assert info.value.path == path
    assert phrase in str(info.value)


def test_host_memory_is_optional_per_group(tmp_path):
    f = tmp_path / "inventory.yaml"
    f.write_text("groups:\n  - {gpu: A800-80GB, nodes: 4, gpus_per_node: 8, host_memory_gb: 1024}\n"
                 "  - {gpu: A40-48GB, nodes: 4, gpus_per_node: 8}\n")
    inv = load_inventory(f)
    assert [g.host_memory_gb for g in inv.groups] == [1024.0, None]


def test_load_inventory_file(tmp_path):
    f = tmp_path / "inventory.yaml"
    f.write_text("groups:\n  - {gpu: H100-SXM-80GB, nodes: 2, gpus_per_node: 8}\n")
    assert load_inventory(f).gpu_counts() == {"H100-SXM-80GB": 16}


def test_inventory_gpu_alias_taken_by_another_entry_is_refused():
    # A custom entry answering to a built-in's reported name would be shadowed by it at run time.
    npu = {"vendor": "Acme", "bf16_tflops": 200, "bf16": True, "fp32_tflops": 50, "memory_gb": 32,
           "memory_bandwidth_gb_s": 1000, "intra_node_link": "PCIe5",
           "intra_node_bandwidth_gb_s": 64, "efficiency": 0.4,
           "aliases": ["Acme NPU", "NVIDIA H100 80GB HBM3"]}
    with pytest.raises(SchemaError, match=r"inv\.yaml: gpus\.MyNPU\.aliases\[1\]: found 'NVIDIA "
                                          r"H100 80GB HBM3'; expected .*H100-SXM-80GB does"):
        inventory_from_data({"gpus": {"MyNPU": npu},
                             "groups": [{"gpu": "MyNPU", "nodes": 1, "gpus_per_node": 8}]},
                            source="inv.yaml")
    # an override keeps the entry's own aliases
    inv = inventory_from_data({"gpus": {"H100-SXM5-80GB": {"efficiency": 0.5}},
                               "groups": [{"gpu": "H100-SXM5-80GB", "nodes": 1,
                                           "gpus_per_node": 8}]})
    assert inv.catalog.resolve("NVIDIA H100 80GB HBM3") == "H100-SXM-80GB"
    assert inv.spec("H100-SXM-80GB").efficiency == 0.5


def test_many_custom_gpus_copy_the_catalog_once(tmp_path, monkeypatch):
    # each entry of `gpus:` used to copy the whole catalog and re-index its aliases: quadratic
    from megatron_hetero.hardware import catalog as catalog_module
    from megatron_hetero.hardware.inventory import load_inventory
    built = []
    real = catalog_module.Catalog.__init__
    monkeypatch.setattr(catalog_module.Catalog, "__init__",
                        lambda self, specs: (built.append(len(specs)), real(self, specs))[1])
    entries = "\n".join(
        f"  G{i}: {{vendor: nvidia, bf16_tflops: 300, bf16: true, fp32_tflops: 20, memory_gb: 80,"
        f" memory_bandwidth_gb_s: 2000, intra_node_link: nvlink, intra_node_bandwidth_gb_s: 300,"
        f" efficiency: 0.5, aliases: [gpu-{i}]}}" for i in range(300))
    path = tmp_path / "inv.yaml"
    path.write_text("groups:\n  - {gpu: gpu-299, nodes: 1, gpus_per_node: 8}\ngpus:\n" + entries + "\n")
    inv = load_inventory(path)
    assert inv.groups[0].gpu == "G299" and inv.spec("gpu-7").name == "G7"
    assert len(built) == 2  # the built-in catalog, then one copy for the whole `gpus:`
