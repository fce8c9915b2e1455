// Small enhancements; every page works without them.
// "Copy" buttons: <button data-copy="#id"> copies the text of the element #id.
document.addEventListener("click", function (event) {
  const button = event.target.closest("button[data-copy]");
  if (!button) return;
  const source = document.querySelector(button.dataset.copy);
  if (!source || !navigator.clipboard) return;
  navigator.clipboard.writeText(source.textContent.trim()).then(function () {
    const label = button.textContent;
    button.textContent = "Copied";
    setTimeout(function () { button.textContent = label; }, 1500);
  });
});
// Copy buttons are useless without a clipboard (or without this script): show them only here.
function revealCopyButtons(root) {
  if (!navigator.clipboard) return;
  root.querySelectorAll("button[data-copy][hidden]").forEach(function (b) { b.hidden = false; });
}
document.addEventListener("DOMContentLoaded", function () { revealCopyButtons(document); });
document.addEventListener("htmx:afterSettle", function (event) { revealCopyButtons(event.target); });
// Live regions poll (hx-trigger="every Ns"); one marked data-pause-while-focused skips its poll
// while focus is inside it, so a swap never takes away what the reader is on. Here rather than
// an hx-trigger condition: those are evaluated code, which the Content-Security-Policy forbids.
document.addEventListener("htmx:beforeRequest", function (event) {
  const region = event.detail.elt;
  if (region.hasAttribute("data-pause-while-focused") && region.contains(document.activeElement)) {
    event.preventDefault();
  }
});
// A running job's output page (<pre data-following data-follow-url ...>) follows the job through
// the logs API, as `gpucp logs -f` does: each request waits (server side) for output past
// next_offset, appends it, and asks again until the attempt has ended.
document.addEventListener("DOMContentLoaded", function () {
  const pre = document.querySelector("pre[data-following][data-follow-url]");
  if (!pre || !window.fetch) return;
  const status = document.getElementById("job-output-status");
  const code = pre.querySelector("code") || pre;
  let next = Number(pre.dataset.nextOffset || "0");
  function follow() {
    const url = pre.dataset.followUrl + "&follow=true&offset=" + next;
    fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" })
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.json();
      })
      .then(function (answer) {
        if (status && status.dataset.lost) {
          status.textContent = "Following: new output appears here as the job writes it.";
          delete status.dataset.lost;
        }
        if (answer.text) {
          const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
          code.appendChild(document.createTextNode(answer.text));
          if (atBottom) pre.scrollTop = pre.scrollHeight;
        }
        next = answer.next_offset;
        if (answer.attempt_finished) {
          if (status) status.textContent = "The attempt has ended; this is all it wrote.";
          pre.removeAttribute("data-following");
          return;
        }
        setTimeout(follow, answer.text ? 0 : 500);
      })
      .catch(function () {
        if (status) {
          status.textContent = "Lost contact; trying again…";
          status.dataset.lost = "1";
        }
        setTimeout(follow, 2000);
      });
  }
  follow();
});
