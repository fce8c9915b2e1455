"""The web UI's input boundary for text the database cannot hold.

Every page reads some of its query string or form into a query (a filter, a slug, a username).
A NUL character there is a database error, so it is refused once, here, for every page: a 400
page that names each parameter at fault. The API (/api/) has its own boundary with JSON errors
(controlplane.api, controlplane.parsers).
"""

from __future__ import annotations

from django.http import Http404
from django.shortcuts import render

from controlplane.validators import problems_in_query_dict, text_problem

API_PREFIX = "/api/"


class UnstorableTextMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path_info.startswith(API_PREFIX):
            return self.get_response(request)
        if text_problem(request.path_info) is not None:
            # A page named by such text (a node, a tenant) cannot exist.
            raise Http404("No such page.")
        problems = problems_in_query_dict(request.GET)
        if request.method == "POST":
            for name, messages in problems_in_query_dict(request.POST).items():
                problems.setdefault(name, []).extend(messages)
        if problems:
            return render(
                request,
                "frontend/bad_request.html",
                {"problems": sorted(problems.items())},
                status=400,
            )
        return self.get_response(request)
