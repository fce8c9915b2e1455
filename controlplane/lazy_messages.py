"""Django's message middleware, with each request's message storage made on first use.

Django makes the storage for every request: the fallback storage, a cookie storage with its
signer, a session storage. Only the web UI's pages add or show messages; an API answer never
does, yet paid about 20 us for it. Here the storage is made when the
request first adds, reads or shows a message, and a request that never did stores nothing at
its end, which is also what Django's storage does when it was neither read nor added to.
"""

from __future__ import annotations

from django.contrib.messages.middleware import MessageMiddleware as DjangoMessageMiddleware
from django.contrib.messages.storage import default_storage
from django.utils.functional import SimpleLazyObject, empty


class MessageMiddleware(DjangoMessageMiddleware):
    def process_request(self, request):
        request._messages = SimpleLazyObject(lambda: default_storage(request))

    def process_response(self, request, response):
        stored = getattr(request, "_messages", None)
        if isinstance(stored, SimpleLazyObject) and stored._wrapped is empty:
            return response  # never added to nor read: nothing to store or to clear
        return super().process_response(request, response)
