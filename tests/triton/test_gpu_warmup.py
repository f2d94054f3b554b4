"""``tools.gpu_warmup``: the expected shapes are parsed with clear errors, the synthetic image keeps its whole
extent through nnU-Net's crop (so the resampled shapes are a real scan's), and the tool segments each case
through a real endpoint (the SynthCT fixture on the embedded server, shared with the CLI tests)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from pipeline_support import REPO_ROOT, SYNTHCT, shared_server

from nnunet_triton.numerics.cropping import crop_to_nonzero
from tools.gpu_warmup import WarmupCase, parse_case, warmup_image

pytestmark = [pytest.mark.triton]


@pytest.fixture(scope="session")
def server(request, triton_server):
    return shared_server(SYNTHCT, triton_server, request)


def test_a_case_is_parsed_from_shape_and_spacing_in_the_readers_axis_order():
    assert parse_case("300x512x512@2.5,0.8,0.8") == WarmupCase((300, 512, 512), (2.5, 0.8, 0.8))


@pytest.mark.parametrize("text", ["300x512@2.5,0.8,0.8", "300x512x512", "300x512x512@2.5,0.8", "0x5x5@1,1,1",
                                  "3x5x5@1,0,1", "axbxc@1,1,1"])
def test_a_malformed_case_is_refused_naming_the_value_and_the_rule(text):
    with pytest.raises(ValueError, match=rf"--case '{text}': expected ZxYxX@sz,sy,sx"):
        parse_case(text)


def test_the_warmup_image_is_nonzero_everywhere_so_the_crop_keeps_its_whole_extent():
    image = warmup_image(WarmupCase((7, 9, 11), (1.0, 1.0, 1.0)), channels=2)
    cropped, _, _ = crop_to_nonzero(image)
    assert image.shape == (2, 7, 9, 11) and cropped.shape == image.shape and np.all(image != 0)


def test_the_warmup_segments_every_expected_case_through_the_endpoint(server):
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_warmup", "--url", server.grpc_url, "--case",
                           "20x24x24@2,1.5,1.5", "--case", "18x26x22@2.5,1.2,1.4"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warmed shape 20x24x24 spacing 2,1.5,1.5" in proc.stderr
    assert "warmed shape 18x26x22 spacing 2.5,1.2,1.4" in proc.stderr
