"""The audit trail: every request that may change something, done or refused, with who, what, where from
and the words the person read; tokens, roles and accounts changed; kept by age."""
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token

from console.choices import AuditOutcome
from console.models import AuditEntry
from console.pruning import old_records_prune
from tests.builders import cluster_of, gpu_machine
from tests.factories import MachineFactory, UserFactory

pytestmark = pytest.mark.django_db


def last(action: str) -> AuditEntry:
    return AuditEntry.objects.filter(action=action).first()


def test_a_page_action_that_was_done_is_recorded_with_who_what_where_from_and_its_message(admin_client, admin_user):
    machine = MachineFactory(name="gpu-old")

    admin_client.post(f"/machines/{machine.pk}/delete/", REMOTE_ADDR="192.0.2.10")

    entry = last("machines:delete")
    assert (entry.user, entry.username, entry.method) == (admin_user, "admin", "POST")
    assert (entry.target, entry.address, entry.status) == (f"/machines/{machine.pk}/delete/", "192.0.2.10", 302)
    assert (entry.outcome, entry.message) == (AuditOutcome.DONE, "gpu-old was deleted.")


def test_a_page_action_that_was_refused_keeps_the_sentence_the_page_showed(admin_client):
    machine = gpu_machine("gpu-a", 11)
    cluster_of([machine])

    admin_client.post(f"/machines/{machine.pk}/delete/")

    entry = last("machines:delete")
    assert entry.outcome == AuditOutcome.REFUSED
    assert "gpu-room" in entry.message


def test_an_api_action_is_recorded_with_the_token_s_user_and_a_refusal_with_its_message(api_client, admin_user, no_ssh):
    machine = MachineFactory(name="gpu-api")
    api_client.delete(f"/api/machines/{machine.pk}/")
    api_client.post("/api/machines/", {"name": "", "address": "198.18.0.9"}, format="json")

    deleted, refused = last("machine-detail"), last("machine-list")
    assert (deleted.user, deleted.method, deleted.outcome, deleted.status) == (admin_user, "DELETE", AuditOutcome.DONE, 204)
    assert (refused.user, refused.outcome, refused.status) == (admin_user, AuditOutcome.REFUSED, 400)
    assert refused.message.startswith("name:")


def test_a_form_shown_again_is_neither_done_nor_refused(admin_client, no_ssh):
    admin_client.post("/machines/add/", {"name": "", "address": ""})

    assert last("machines:add").outcome == AuditOutcome.SHOWN


def test_refusals_before_any_view_are_recorded_too():
    machine = MachineFactory()
    Client().post(f"/machines/{machine.pk}/delete/")  # not signed in
    signed_in = Client(enforce_csrf_checks=True)
    signed_in.force_login(UserFactory(username="ada"))
    signed_in.post(f"/machines/{machine.pk}/delete/")  # no CSRF token

    anonymous, forged = AuditEntry.objects.filter(action="machines:delete").order_by("id")
    assert (anonymous.user, anonymous.outcome, anonymous.message) == (None, AuditOutcome.REFUSED, "Not signed in.")
    assert (forged.username, forged.outcome, forged.status) == ("ada", AuditOutcome.REFUSED, 403)


def test_reads_and_the_machines_own_endpoints_are_not_recorded(admin_client):
    before = AuditEntry.objects.count()
    admin_client.get("/machines/")
    Client().post("/agent/heartbeat/", "{}", content_type="application/json", headers={"Authorization": "Bearer x"})

    assert AuditEntry.objects.count() == before


def test_a_server_error_is_recorded_as_failed(admin_client, monkeypatch):
    from machines import services

    def breaks(**kwargs):
        raise RuntimeError("the disk is gone")

    monkeypatch.setattr(services, "machine_delete", breaks)
    admin_client.raise_request_exception = False
    machine = MachineFactory()

    admin_client.post(f"/machines/{machine.pk}/delete/")

    entry = last("machines:delete")
    assert (entry.outcome, entry.status) == (AuditOutcome.FAILED, 500)
    assert "the disk is gone" not in entry.message


def test_api_tokens_made_and_revoked_are_recorded_with_who_did_it(admin_client, admin_user):
    ada = UserFactory(username="ada")
    admin_client.post("/admin/authtoken/tokenproxy/add/", {"user": ada.pk}, REMOTE_ADDR="192.0.2.20")
    Token.objects.get(user=ada).delete()  # as `faden shell` would: no request, the server did it

    made, revoked = last("token.created"), last("token.revoked")
    assert (made.user, made.address, made.target, made.message) == (admin_user, "192.0.2.20", "user ada", "An API token was made for ada.")
    assert (revoked.user, revoked.address, revoked.message) == (None, None, "The API token of ada was revoked.")
    assert Token.objects.count() == 0


def test_roles_given_and_taken_are_recorded_from_either_side():
    ada = UserFactory(username="ada", is_superuser=False)
    operator, viewer = Group.objects.create(name="Operator"), Group.objects.create(name="Viewer")

    ada.groups.add(operator, viewer)
    viewer.user_set.remove(ada)
    ada.groups.clear()

    said = list(AuditEntry.objects.filter(action="user.groups").order_by("id").values_list("target", "message"))
    assert said == [("user ada", "Added to Operator, Viewer."), ("user ada", "Removed from Viewer."), ("user ada", "Removed from Operator.")]


def test_an_account_s_flags_and_password_changed_are_recorded():
    ada = UserFactory(username="ada")
    ada.is_superuser = False
    ada.set_password("a-new-and-long-password")
    ada.save()
    ada.is_active = False
    ada.save(update_fields=["is_active"])

    said = list(AuditEntry.objects.filter(action="user.changed").order_by("id").values_list("message", flat=True))
    assert said == ["Password changed. No longer a superuser.", "Deactivated."]


def test_entries_older_than_the_setting_says_are_pruned_and_newer_ones_kept(settings):
    settings.FADEN_KEEP_AUDIT_DAYS = 30
    old = AuditEntry.objects.create(action="machines:delete", outcome=AuditOutcome.DONE, at=timezone.now() - timedelta(days=31))
    new = AuditEntry.objects.create(action="machines:delete", outcome=AuditOutcome.DONE, at=timezone.now() - timedelta(days=29))

    deleted = old_records_prune()

    assert deleted["audit"] == 1
    assert list(AuditEntry.objects.values_list("pk", flat=True)) == [new.pk]
    assert not AuditEntry.objects.filter(pk=old.pk).exists()


# -- the page ---------------------------------------------------------------------------------


def test_administrators_read_the_trail_newest_first_and_filter_it(admin_client):
    AuditEntry.objects.create(action="clusters:stop", username="ada", outcome=AuditOutcome.REFUSED, message="It is busy.")
    AuditEntry.objects.create(action="machines:delete", username="grace", outcome=AuditOutcome.DONE, message="gpu-a was deleted.")

    page = admin_client.get("/audit/").content.decode()
    refused = admin_client.get("/audit/?outcome=refused&user=ad").content.decode()

    assert page.index("gpu-a was deleted.") < page.index("It is busy.")
    assert "It is busy." in refused and "gpu-a was deleted." not in refused
    assert 'href="/audit/"' in page  # the side bar's link


def test_other_users_may_not_read_it_nor_see_its_link(client):
    client.force_login(UserFactory(username="ada", is_superuser=False, is_staff=False))

    assert client.get("/audit/").status_code == 403
    assert 'href="/audit/"' not in client.get("/machines/").content.decode()


def test_a_member_of_the_administrator_group_may_read_it(client):
    ada = UserFactory(username="ada", is_superuser=False, is_staff=False)
    ada.groups.add(Group.objects.create(name="Administrator"))
    client.force_login(ada)

    assert client.get("/audit/").status_code == 200
