"""The cluster file doctor writes and plan/train read (--cluster)."""

import pytest

from homelab_ft.cluster import clusterfile
from homelab_ft.errors import UserError
from homelab_ft.recipe.config import recipe_from_dict


def test_round_trip_as_overrides(tmp_path):
    path = tmp_path / "cluster.yaml"
    clusterfile.write(path, cluster={"nodes": 2, "gpus_per_node": 1, "device": "cuda", "vram_gib": 23.6,
                                     "gpu_name": "NVIDIA GeForce RTX 3090", "inter_link_gbit": 0.94,
                                     "inter_latency_ms": 0.21, "intra_link_gbit": None},
                      measured={"nodes": [{"host": "a"}]}, header="written by a test")
    assert path.read_text().startswith("# written by a test\n")
    recipe = recipe_from_dict({"name": "x", "model": {"path": "m"}, "data": {"sources": [{"path": "d.jsonl"}]}},
                              overrides=clusterfile.overrides(path))
    c = recipe.cluster
    assert (c.nodes, c.device, c.vram_gib, c.gpu_name, c.inter_link_gbit, c.inter_latency_ms) == (
        2, "cuda", 23.6, "NVIDIA GeForce RTX 3090", 0.94, 0.21)
    assert c.intra_link_gbit is None
    assert c.inter_link_measured  # a measured bandwidth: the planner takes it as it is
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("text, says", [
    ("format: homelab-ft-cluster/1\ncluster: {nodes: 0}\n", "cluster.nodes: Input should be greater than or equal to 1"),
    ("format: homelab-ft-cluster/1\ncluster: {nodez: 2}\n", "cluster.nodez is not a cluster setting"),
    ("format: homelab-ft-cluster/1\ncluster: {inter_link_gbit: fast}\n", "cluster.inter_link_gbit: Input should be a valid number"),
    ("name: a recipe\n", "not a homelab-ft cluster file"),
    ("cluster: [\n", "not a readable YAML file"),
])
def test_bad_files_name_file_and_field(tmp_path, text, says):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        clusterfile.overrides(path)
    assert str(path) in str(err.value) and says in str(err.value)
    assert "\n" not in str(err.value) and "[type=" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="no such file; run `homelab-ft doctor"):
        clusterfile.read(tmp_path / "nope.yaml")


@pytest.mark.timeout(20)
@pytest.mark.parametrize("text, says", [
    ("format: homelab-ft-cluster/1\ncluster: &c {nodes: 2, again: *c}\n", "refers to itself"),
    ("format: homelab-ft-cluster/1\na0: &a0 [x, x, x, x, x, x, x, x, x, x]\n"
     + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10)) + "cluster: {nodes: 2}\n",
     "expand to more than"),
    ("format: homelab-ft-cluster/1\ncluster: {nodes: 2}\nx: " + "[" * 5000 + "]" * 5000 + "\n", "nest deeper than"),
])
def test_recursive_anchors_and_alias_bombs_are_one_line(tmp_path, text, says):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        clusterfile.read(path)
    assert str(path) in str(err.value) and says in str(err.value) and "\n" not in str(err.value)
