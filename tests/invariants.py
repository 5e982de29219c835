"""Which tests protect which invariant of DESIGN section 4 (``pytest -m invariant_4`` runs the
budget invariant's tests, on both backends wherever the test takes ``db_url``).

The conftest marks every test named here with ``invariant_N``; ``tests/test_invariant_map.py``
holds the map honest (each name a real test, each invariant with tests on both backends), and
``docs/concepts.md`` lists the same tests.
"""

from __future__ import annotations

INVARIANTS: dict[int, tuple[str, ...]] = {
    # 1. Every physical call has an Attempt row committed before the request is sent.
    1: (
        "tests/run/test_attempt_before_send.py::test_invariant1_every_attempt_is_committed_before_its_request_is_sent",
        "tests/recovery/test_crash.py::test_kill_at_every_fault_point_then_recover",
        "tests/storage/test_lost_acknowledgement.py::test_every_commit_of_a_session_whose_acknowledgement_is_lost_is_resolved_truthfully",
    ),
    # 2. Settled Attempts are immutable; duplicate settles/submissions are the same write.
    2: (
        "tests/storage/test_write_path.py::test_admit_freezes_and_duplicate_returns_first_identity",
        "tests/storage/test_write_path.py::test_admit_conflict_names_every_differing_field",
        "tests/storage/test_idempotency.py::test_invariant2_one_budget_spelled_three_ways_is_one_admission",
        "tests/storage/test_idempotency.py::test_invariant2_minus_zero_and_zero_are_one_admission",
        "tests/storage/test_idempotency.py::test_invariant2_begin_retried_after_a_lost_ack_under_the_same_lease",
        "tests/storage/test_idempotency.py::test_invariant2_begin_retried_under_a_lease_acquired_again_is_adopted",
        "tests/storage/test_bounded_values.py::test_property_settle_stores_exactly_what_it_accepts",
        "tests/decide/test_write_rules.py::test_a_begin_retried_under_a_new_fence_is_the_same_write",
        "tests/decide/test_write_rules.py::test_the_settle_hash_covers_the_receipt",
        "tests/recovery/test_settle_unknown.py::test_an_attempt_moves_out_of_unknown_exactly_once",
        "tests/recovery/test_settle_unknown.py::test_the_executors_repeated_unknown_settle_after_the_receipt_changes_nothing",
        "tests/run/test_failed_attempt_facts.py::test_invariant2_a_failed_attempts_reported_model_settles_again_as_the_same_write",
    ),
    # 3. A stale executor or a lapsed lease starts nothing; its late settle is a late receipt.
    3: (
        "tests/storage/test_write_path.py::test_lease_fence_and_stale_executor_refused_everywhere",
        "tests/storage/test_concurrency.py::test_stale_fence_never_writes_from_other_processes",
        "tests/storage/test_lease_liveness.py::test_invariant3_expired_lease_begins_nothing_and_the_group_limit_holds",
        "tests/storage/test_lease_liveness.py::test_invariant3_a_lease_ending_within_the_margin_starts_nothing",
        "tests/storage/test_lease_liveness.py::test_invariant3_renewing_a_lapsed_lease_is_refused_and_resurrects_no_slot",
        "tests/storage/test_lease_liveness.py::test_invariant3_released_lease_begins_renews_and_releases_nothing",
        "tests/storage/test_lease_liveness.py::test_invariant3_settle_after_expiry_is_accepted_until_someone_takes_over",
        "tests/storage/test_lease_liveness.py::test_invariant3_settle_after_a_takeover_is_a_late_receipt_that_changes_no_row",
        "tests/storage/test_lease_liveness.py::test_invariant3_reacquired_run_refuses_settles_of_the_older_fence",
        "tests/storage/test_lease_liveness.py::test_invariant3_a_begin_that_waited_for_the_lock_is_judged_when_it_got_it",
        "tests/session/test_fork_after_open.py::test_a_forked_child_is_an_executor_of_its_own_so_one_of_parent_and_child_holds_a_run",
    ),
    # 4. Budgets and allowances are never overdrawn; children come out of their parent.
    4: (
        "tests/storage/test_write_path.py::test_budget_and_allowance_refuse_without_overdraw",
        "tests/storage/test_write_path.py::test_child_budget_carved_and_broader_refused",
        "tests/storage/test_write_path.py::test_invariant4_a_budget_finer_than_a_micro_is_rounded_down_and_never_overdrawn",
        "tests/storage/test_concurrency.py::test_budget_never_overdrawn_by_concurrent_processes",
        "tests/storage/test_concurrency.py::test_call_allowance_never_exceeded",
        "tests/storage/test_concurrency.py::test_child_carving_under_concurrency",
        "tests/storage/test_child_give_back.py::test_invariant4_every_ending_of_a_child_gives_back_exactly_what_it_did_not_use",
        "tests/storage/test_child_give_back.py::test_invariant4_an_ended_child_never_spends_what_it_gave_back",
        "tests/storage/test_child_give_back.py::test_invariant4_children_ending_while_the_parent_and_siblings_carve_and_begin",
        "tests/storage/test_child_give_back.py::test_invariant4_a_hold_recovery_voids_in_an_ended_child_goes_back_to_its_parent",
        "tests/run/test_budgets.py::test_invariant4_token_budget_is_held_posted_and_never_moves_on",
        "tests/run/test_budgets.py::test_invariant4_tokens_are_rechecked_before_a_retry_or_failover",
        "tests/run/test_budgets.py::test_invariant4_token_hold_posts_the_reported_usage",
        "tests/run/test_budgets.py::test_invariant4_a_switch_after_an_admission_rejection_takes_a_retry_permission",
        "tests/run/test_retry_owner.py::test_call_allowance_bounds_the_loop",
        "tests/decide/test_write_rules.py::test_a_settle_never_posts_more_than_its_hold_and_posts_all_of_it_when_unreported",
        "tests/decide/test_write_rules.py::test_a_child_is_never_broader_than_its_parent",
        "tests/session/test_multimodal_runs.py::test_the_budget_holds_a_documents_pages_before_anything_is_sent",
    ),
    # 5. Frozen plan, grant, budget and policy; history read under its original routes.
    5: (
        "tests/storage/test_write_path.py::test_admit_freezes_and_duplicate_returns_first_identity",
        "tests/test_pricing.py::test_admission_freezes_the_table_price_in_the_plan",
        "tests/storage/test_child_narrowing.py::test_child_runs_under_the_parents_frozen_policy",
        "tests/session/test_session.py::test_the_runs_frozen_streaming_limits_reach_the_adapter",
        "tests/storage/test_frozen_run.py::test_invariant5_the_frozen_run_never_carries_counters_that_go_stale",
        "tests/decide/test_write_rules.py::test_a_begin_uses_the_frozen_snapshot_of_a_planned_route_only",
    ),
    # 6. Recovery never re-sends; unknown stays unknown with its hold.
    6: (
        "tests/recovery/test_recover_api.py::test_takeover_marks_unknown_keeps_hold_and_fences",
        "tests/recovery/test_recover_api.py::test_orphans_of_a_directly_reacquired_run",
        "tests/recovery/test_crash.py::test_kill_at_every_fault_point_then_recover",
        "tests/recovery/test_pg_restart.py::test_restart_under_workers",
        "tests/run/test_retry_owner.py::test_read_timeout_is_unknown_and_never_resubmitted_by_default",
        "tests/run/test_cancellation.py::test_cancel_mid_stream_is_unknown_with_its_hold",
        "tests/decide/test_write_rules.py::test_an_unknown_outcome_keeps_both_holds_and_not_sent_voids_them",
        "tests/run/test_stream_endings.py::test_cut_with_buffered_output_is_unknown_discarded_and_keeps_its_hold",
    ),
    # 7. Disclosure: approved recipients only; model-derived parts need matching provenance.
    7: (
        "tests/run/test_retry_owner.py::test_disclosure_skips_unapproved_recipient",
        "tests/run/test_retry_owner.py::test_model_derived_context_needs_recorded_provenance",
        "tests/session/test_session.py::test_an_edited_copy_in_place_of_a_recorded_part_is_refused_across_turns",
        "tests/session/test_session.py::test_invariant7_a_covered_answer_changed_in_place_is_hashed_again_and_not_sent",
        "tests/decide/test_preflight.py::test_edited_copy_does_not_inherit_provenance",
        "tests/decide/test_select.py::test_envelope_with_tampered_provenance_is_not_sent_anywhere",
        "tests/session/test_multimodal_runs.py::test_a_private_document_is_disclosed_by_its_class_and_needs_its_provenance",
        "tests/session/test_media_out_runs.py::test_the_models_image_is_a_covered_part_the_next_turn_carries",
        "tests/session/test_session.py::test_a_models_answer_rebuilt_by_hand_is_model_output_and_needs_its_provenance",
        "tests/decide/test_preflight.py::test_a_models_or_tools_part_relabelled_as_exempt_still_needs_provenance",
        "tests/session/test_session.py::test_invariant7_a_childs_answer_is_covered_in_its_runs_tree_and_in_no_other",
        "tests/session/test_session.py::test_invariant7_a_ref_two_runs_of_a_tree_recorded_differently_covers_either_content",
        "tests/decide/test_preflight.py::test_invariant7_a_link_a_model_or_a_tool_chose_is_refused_for_every_route",
        "tests/session/test_media_out_runs.py::test_invariant7_a_link_the_model_chose_is_never_sent_for_a_provider_to_fetch",
        "tests/session/test_multimodal_runs.py::test_invariant7_a_link_a_tool_returned_is_refused_whatever_its_class",
        "tests/session/test_session.py::test_invariant7_a_host_cannot_record_provenance_for_a_models_output",
        "tests/session/test_multimodal_runs.py::test_invariant7_a_tools_file_cannot_be_relabelled_as_the_users_input",
        "tests/session/test_params_disclosure.py::test_invariant7_tool_definitions_in_params_reach_no_recipient_unapproved_for_them",
        "tests/session/test_params_disclosure.py::test_invariant7_a_tool_spec_data_class_adds_to_tool_description_never_replaces_it",
        "tests/session/test_params_disclosure.py::test_invariant7_no_request_makes_the_provider_forward_content_to_an_unapproved_server",
        "tests/session/test_params_disclosure.py::test_invariant7_a_long_mcp_server_url_can_be_granted_and_is_refused_unless_it_is",
    ),
    # 8. Group limits hold across processes; dead executors' slots come back.
    8: (
        "tests/storage/test_concurrency.py::test_group_limit_never_exceeded_across_processes",
        "tests/storage/test_write_path.py::test_dead_executor_slot_comes_back_after_lease_expiry",
        "tests/storage/test_lease_liveness.py::test_invariant8_acquiring_ones_own_live_lease_keeps_its_fence_and_slot",
        "tests/storage/test_lease_liveness.py::test_invariant8_every_reader_counts_in_flight_alike_and_a_taken_over_slot_counts_for_none",
        "tests/storage/test_lease_lapse_processes.py::test_invariant8_group_limit_holds_while_workers_pause_past_their_lease",
        "tests/storage/test_group_ceiling.py::test_invariant8_group_limit_exact_when_many_processes_hammer_one_group",
        "tests/storage/test_group_ceiling.py::test_invariant8_slot_numbers_stay_within_the_limit_and_unique",
        "tests/storage/test_group_ceiling.py::test_invariant8_a_lapsed_slot_number_is_taken_over_and_counted_once",
        "tests/storage/test_group_ceiling.py::test_invariant8_a_lowered_limit_admits_nothing_until_in_flight_is_below_it",
        "tests/storage/test_group_ceiling.py::test_invariant8_a_begin_is_refused_only_when_the_group_is_full_not_when_its_numbers_moved",
    ),
    # 9. No re-run after a started tool; effective output moves on only where policy discards it.
    9: (
        "tests/run/test_retry_owner.py::test_default_never_moves_after_effective_output",
        "tests/session/test_session.py::test_a_started_tool_stops_the_turn_instead_of_moving_on",
        "tests/decide/test_select.py::test_tool_started_always_stops_even_when_output_is_discarded",
        "tests/decide/test_select.py::test_effective_output_stops_unless_the_policy_discards_it",
        "tests/run/test_hosted_tools.py::"
        "test_invariant9_a_failure_after_a_hosted_tool_ran_is_never_sent_to_another_route",
        "tests/run/test_hosted_tools.py::"
        "test_invariant9_a_hosted_tool_stops_even_a_preset_that_resubmits_unknown_executions",
    ),
}


def invariants_of(nodeid: str) -> list[int]:
    """The invariants a collected test protects (its node id without parameters)."""
    base = nodeid.split("[", 1)[0]
    return [n for n, tests in INVARIANTS.items() if base in tests]
