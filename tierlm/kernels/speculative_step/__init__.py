"""The small index work of a greedy speculative step on the device (model/speculative_step.py), outside its
forwards: the verify rows' inputs, the acceptance, and the next chained step's inputs.

Signatures (every form; T = 1 + K rows per request, n requests, int64 tensors on one device):
  step_inputs(candidates [C], picks [n T], positions [n T], block_tables [n, width], block_size,
              scratch_block, token_ids [n T] (out), slot_mapping [n T] (out)) -> None
      token_ids[r] = candidates[picks[r]]; slot_mapping[r] = the K/V row of position positions[r] in the
      block table of request r // T (a negative entry, or a column past the table: the scratch block).
  accept_drafts(best [n, T], token_ids [n T], positions [n T], verify_slots [n, T], block_tables [n, width],
                block_size, scratch_block, readback [n, 2 + K] (out: columns 0, 1)) -> Accepted
      best: each verify row's argmax; request i accepts a_i drafts (those equal to the argmax of the row
      before them, from the first on), readback[i, 0] = a_i, readback[i, 1] = best[i, a_i]; Accepted: row a_i
      of each request (i T + a_i), its slot verify_slots[i, a_i] and the next one round (a_i + 1) % T, the
      draft steps' positions start_i + a_i + s and K/V rows (s = 1 .. K-1, [K-1, n]).
  finish_step(readback [n, 2 + K] (columns 0, 1 filled), drafts [K, n], following: NextInputs | None) -> None
      readback[:, 2:] = drafts.T; with `following` (the fixed-shape runner's input buffers), the inputs of
      the step chained after this one, from its outcome: the row slots turned round by a_i + 1, the state
      slot the last of them, the start advanced by 1 + a_i, the positions from there, the ids the token
      after the accepted drafts and the K drafts (padding requests, in the scratch slot, stay padding).
  naive.py   the torch ops (the reference; what the CPU runs): ~30 small kernels on a GPU at K = 1
  triton.py  one launch each (a program per request, or per block of rows), with programmatic dependent
             launch (kernels/dependent_launch); TIERLM_NO_FUSED_SPECULATIVE_STEP=1 turns them off
"""

from tierlm.kernels.speculative_step.naive import (
    Accepted,
    NextInputs,
    accept_drafts,
    finish_step,
    step_inputs,
)

__all__ = ["Accepted", "NextInputs", "accept_drafts", "finish_step", "step_inputs"]
