from tests.lab_fixtures import console_url, lab, lab_dir, lab_machine  # noqa: F401
