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
