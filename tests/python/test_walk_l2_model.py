"""scripts/walk_l2_model.py, the L2 model of the row-tile GEMMs' walk: the 128-row tiles' bytes
as session 34 counted them, and the 192-row tiles' walks, where a static walk over tiles of
unlike cost (3 + 2 chunks an expert) reads the weights again and by ticket it does not."""

from __future__ import annotations

from repo_scripts import load_script


def test_128_row_tiles_read_what_the_model_counted_before_the_192_row_options():
    model = load_script("walk_l2_model")
    gate_up = model.FORMS["fp8"]["gate_up"]
    gb, end = model.dram_bytes("fixed", 8, [9] * 8, gate_up, 40, 132, 0.02, 5)
    assert round(gb * 1e9) == 537198592  # the model's count at b9d9db3, one block per miss
    assert end > 0


def test_tiles_of_one_cost_read_the_same_bytes_static_or_by_ticket():
    model = load_script("walk_l2_model")
    down = model.FORMS["fp8"]["down"]
    static = model.dram_bytes("fixed", 8, [2] * 16, down, 50, 132, 0.0, 5, [3, 3] * 16, False)
    ticket = model.dram_bytes("fixed", 8, [2] * 16, down, 50, 132, 0.0, 5, [3, 3] * 16, True)
    assert static == ticket


def test_a_static_walk_over_unlike_tiles_reads_the_weights_again_and_tickets_do_not():
    model = load_script("walk_l2_model")
    down = model.FORMS["fp8"]["down"]
    padded, padded_end = model.dram_bytes("fixed", 8, [2] * 16, down, 50, 132, 0.0, 5, [3, 3] * 16)
    static, static_end = model.dram_bytes("fixed", 8, [2] * 16, down, 50, 132, 0.0, 5, [3, 2] * 16)
    ticket, ticket_end = model.dram_bytes(
        "fixed", 8, [2] * 16, down, 50, 132, 0.0, 5, [3, 2] * 16, True
    )
    # CTA c takes tiles of c's parity: the odd CTAs' cheaper tiles run ahead of their partners.
    assert static > 1.3 * padded
    assert static_end == padded_end  # the three-chunk CTAs set the end, as padded
    assert ticket < 1.01 * padded
    assert ticket_end < 0.95 * static_end
