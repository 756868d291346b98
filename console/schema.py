"""The OpenAPI schema states every code an operation answers, errors included.

drf-spectacular documents the success codes each view declares; the refusals are the same for
every view and come from ``console.api`` (its exception handler, parser and pagination), so they
are added here once, by what the operation takes: every operation may answer 401 and 403 (an
account without a role reads nothing; an action above one's role is refused: console/roles.py), one
with a path parameter or a page 404, one that takes a body or a query (or changes something) 400,
one that reads a body 413 and 415. Integer parameters (ids, page numbers) carry the bounds
``console.params`` reads them within; an optional query parameter left blank is not given.
The fuzzer (tests/api/test_fuzz.py) holds the API to this.
"""
from drf_spectacular.openapi import AutoSchema

from console import params
from console.api import ErrorSerializer

WHY = {
    "400": "Refused: the request or the object's state does not allow it; `message` says why",
    "401": "No valid token or session",
    "403": "Signed in, but the role may not do this (or the account has no role); `message` names the role it needs",
    "404": "No such object, or no such page of the list",
    "413": "The body is larger than the console accepts",
    "415": "The body is not JSON (application/json)",
}


class ConsoleAutoSchema(AutoSchema):
    def get_operation(self, path, path_regex, path_prefix, method, registry):
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        parameters = operation.get("parameters", [])
        for parameter in parameters:
            if parameter["schema"].get("type") == "integer":  # ids and page numbers, in a path or a query
                parameter["schema"].update(minimum=1, maximum=params.ID_MAX)
            if parameter["in"] == "query" and not parameter.get("required"):
                parameter["allowEmptyValue"] = True  # ?page= is no page at all (console.params), as in a form
        for code in self._error_codes(operation):
            if code not in operation["responses"]:
                operation["responses"][code] = {
                    **self._get_response_for_code(ErrorSerializer, code), "description": WHY[code]}
        return operation

    def _error_codes(self, operation: dict) -> list[str]:
        where = {parameter["in"] for parameter in operation.get("parameters", [])}
        codes = ["401", "403"]
        if "path" in where or self._is_list_view() and self._get_paginator():
            codes.append("404")
        if self.method != "GET" or "query" in where:
            codes.append("400")
        if "requestBody" in operation:
            codes += ["413", "415"]
        return codes
