"""The API's Swagger page needs no internet: its scripts, styles and icon are the console's own files."""
import re

import pytest

pytestmark = pytest.mark.django_db


def test_the_swagger_page_loads_every_asset_from_the_console_itself(admin_client):
    page = admin_client.get("/api/schema/swagger/").content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)

    assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
    for asset in assets:
        assert asset.startswith(("/static/", "/api/schema/swagger/?")), f"{asset} is not served by the console"
    for asset in (a for a in assets if a.startswith("/static/")):  # the page's own script: the test below
        response = admin_client.get(asset)
        assert response.status_code == 200, asset
        response.close()


def test_the_swagger_page_has_no_inline_script_or_style_and_its_script_is_javascript(admin_client):
    page = admin_client.get("/api/schema/swagger/").content.decode()
    [script_url] = re.findall(r'<script src="(/api/schema/swagger/\?[^"]*)"', page)
    script = admin_client.get(script_url.replace("&amp;", "&"))

    assert re.findall(r"<script(?![^>]*\bsrc=)[^>]*>", page) == []
    assert "<style" not in page and " style=" not in page
    assert script.status_code == 200
    assert script["Content-Type"].startswith("application/javascript")
    assert "SwaggerUIBundle" in script.content.decode()
