/*
 * Fadenstack console: the little script every page loads (after htmx, deferred).
 *
 * 1. The live dot: the page header says whether the websocket that feeds the
 *    live cards is open. htmx-ext-ws fires htmx:wsOpen / htmx:wsClose on the
 *    element holding ws-connect; the events bubble to document. The console
 *    closes a socket with a code of its own when the session ended (the page
 *    stops) or the user's role changed (the page connects again at once: the
 *    extension itself reconnects only after a network error).
 * 2. Copy buttons: <button data-copy="#key"> copies the text of #key;
 *    data-copy="some text" copies that text; an empty data-copy copies the
 *    .copy__text (or pre, code) of the enclosing .copy block.
 *    The console is often served over plain http on a LAN, where
 *    navigator.clipboard does not exist; a hidden textarea is the fallback.
 *
 * The "live-if-shown" htmx extension (on the ws-connect element, beside "ws")
 * drops, from each live message, the parts marked data-live-if-shown whose
 * element is not on the page: a list's row pushed to a page filtered or paged
 * past it, or an empty-list note already gone. Left in, htmx would log an
 * oobErrorNoTarget for each.
 */
(function () {
  "use strict";

  // 1. Live dot -------------------------------------------------------------

  // Close codes of console/live_sessions.py and console/consumers.py.
  var SESSION_ENDED = 4401; // logged out, new password or account closed
  var NOT_ALLOWED = 4403; // no role, or a topic this user may not watch
  var RECONNECT = 4000; // the user's role changed: the cards come again, rendered for the new one

  function setLive(on, label, title) {
    document.querySelectorAll("[data-live-dot]").forEach(function (dot) {
      dot.classList.toggle("live-dot--on", on);
      dot.classList.toggle("live-dot--off", !on);
      dot.textContent = label;
      dot.title = title || (on
        ? "Live: this page updates by itself."
        : "Not connected: the page does not update by itself until it reconnects. Reload to see the latest.");
    });
  }

  function closed(event) {
    var code = event.detail && event.detail.event && event.detail.event.code;
    if (code === SESSION_ENDED) {
      setLive(false, "Signed out", "Your session ended (logged out, new password or account closed): the page no longer updates. Reload to sign in again.");
    } else if (code === NOT_ALLOWED) {
      setLive(false, "Not allowed", "The console refused this page's live updates (your account may have no role now). Reload to see why.");
    } else if (code === RECONNECT && event.detail.socketWrapper) {
      event.detail.socketWrapper.reconnect(); // fires htmx:wsConnecting, then htmx:wsOpen
    } else {
      setLive(false, "Reconnecting…");
    }
  }

  document.addEventListener("htmx:wsConnecting", function () { setLive(false, "Connecting…"); });
  document.addEventListener("htmx:wsOpen", function () { setLive(true, "Live"); });
  document.addEventListener("htmx:wsClose", closed);
  document.addEventListener("htmx:wsError", function () { setLive(false, "Reconnecting…"); });

  htmx.defineExtension("live-if-shown", {
    transformResponse: function (text, xhr) {
      if (xhr !== null || text.indexOf("data-live-if-shown") < 0) return text; // only the socket's messages
      var template = document.createElement("template");
      template.innerHTML = text;
      Array.from(template.content.children).forEach(function (part) {
        if (part.hasAttribute("data-live-if-shown") && !document.getElementById(part.id)) part.remove();
      });
      return template.innerHTML;
    }
  });

  // 2. Copy buttons ---------------------------------------------------------

  function textToCopy(button) {
    var source = button.getAttribute("data-copy");
    if (source && source.charAt(0) === "#") {
      var target = document.querySelector(source);
      if (!target) return "";
      return /^(INPUT|TEXTAREA)$/.test(target.tagName) ? target.value : target.textContent;
    }
    if (source) return source;
    var block = button.closest(".copy");
    var text = block && block.querySelector(".copy__text, pre, code");
    return text ? text.textContent : "";
  }

  function copyWithTextarea(text) {
    var area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    var ok = false;
    try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
    document.body.removeChild(area);
    return ok ? Promise.resolve() : Promise.reject(new Error("copy refused"));
  }

  function copy(text) {
    if (navigator.clipboard && window.isSecureContext) {
      return navigator.clipboard.writeText(text).catch(function () { return copyWithTextarea(text); });
    }
    return copyWithTextarea(text);
  }

  function flash(button, label, className) {
    if (!button.dataset.copyLabel) button.dataset.copyLabel = button.textContent;
    button.textContent = label;
    button.classList.add(className);
    clearTimeout(button._copyTimer);
    button._copyTimer = setTimeout(function () {
      button.textContent = button.dataset.copyLabel;
      button.classList.remove(className);
    }, 1600);
  }

  document.addEventListener("click", function (event) {
    var button = event.target.closest("[data-copy]");
    if (!button) return;
    event.preventDefault();
    var text = textToCopy(button).trim();
    copy(text).then(
      function () { flash(button, "Copied", "is-copied"); },
      function () { flash(button, "Select and copy", "is-copy-failed"); }
    );
  });
})();

// Relative times: <time class="ago" datetime="ISO"> reads "12 s ago" and keeps ticking, so the
// server need not push anything for a heartbeat that only moves "last seen" along.
(function () {
  "use strict";

  function ago(seconds) {
    if (seconds < 5) return "just now";
    if (seconds < 60) return Math.floor(seconds) + " s ago";
    if (seconds < 3600) return Math.floor(seconds / 60) + " min ago";
    if (seconds < 86400) return Math.floor(seconds / 3600) + " h ago";
    return Math.floor(seconds / 86400) + " d ago";
  }

  function tick() {
    var now = Date.now();
    document.querySelectorAll("time.ago[datetime]").forEach(function (el) {
      var at = Date.parse(el.getAttribute("datetime"));
      if (!isNaN(at)) {
        el.textContent = ago(Math.max(0, (now - at) / 1000));
        el.title = new Date(at).toLocaleString();
      }
    });
  }

  document.addEventListener("DOMContentLoaded", tick);
  document.addEventListener("htmx:afterSettle", tick);
  document.addEventListener("htmx:wsAfterMessage", tick);
  setInterval(tick, 5000);
})();

// A cluster's page: selecting a machine (in the diagram or the table) shows its panel. The choice
// lives in the URL (?machine=12), so a reload or a shared link opens the same panel; every panel is
// in the page, so a live push that re-renders the card keeps the selection by applying it again.
// Dialogs: <button data-dialog-open="id"> opens <dialog id="id"> as a modal.
(function () {
  "use strict";

  function selected() {
    return new URL(window.location.href).searchParams.get("machine") || "";
  }

  function apply() {
    var panels = document.querySelectorAll("[data-machine-panel]");
    if (!panels.length) return;
    var id = selected();
    var found = false;
    panels.forEach(function (panel) {
      var match = id !== "" && panel.getAttribute("data-machine-panel") === id;
      panel.hidden = !match;
      found = found || match;
    });
    if (!found) {
      var empty = document.querySelector('[data-machine-panel=""]');
      if (empty) empty.hidden = false;
    }
    document.querySelectorAll("[data-machine-id]").forEach(function (el) {
      el.classList.toggle("is-selected", found && el.getAttribute("data-machine-id") === id);
    });
  }

  document.addEventListener("click", function (event) {
    var link = event.target.closest("[data-select-machine]");
    if (!link || event.metaKey || event.ctrlKey || event.shiftKey) return;
    event.preventDefault();
    var id = link.getAttribute("data-select-machine");
    var url = new URL(window.location.href);
    if (url.searchParams.get("machine") === id) url.searchParams.delete("machine");
    else url.searchParams.set("machine", id);
    window.history.pushState(null, "", url);
    apply();
  });

  document.addEventListener("click", function (event) {
    var opener = event.target.closest("[data-dialog-open]");
    if (!opener) return;
    var dialog = document.getElementById(opener.getAttribute("data-dialog-open"));
    if (dialog && dialog.showModal) {
      event.preventDefault();
      dialog.showModal();
    }
  });

  window.addEventListener("popstate", apply);
  document.addEventListener("DOMContentLoaded", apply);
  document.addEventListener("htmx:wsAfterMessage", apply);
  document.addEventListener("htmx:afterSettle", apply);
})();

// What the Content-Security-Policy keeps out of the HTML (no inline style or handler) is done here:
// - progress bars: <div class="bar__fill" data-percent="42"> gets its width, on load and on every
//   swap (htmx fires htmx:load on new content in the same task as the swap, so a pushed bar is first
//   painted at its width, as it was with a style attribute);
// - <select data-submit-on-change> submits its form when changed.
(function () {
  "use strict";

  function fillBars(root) {
    var bars = root.matches && root.matches("[data-percent]") ? [root] : [];
    root.querySelectorAll("[data-percent]").forEach(function (bar) { bars.push(bar); });
    bars.forEach(function (bar) {
      var percent = Math.min(100, Math.max(0, parseFloat(bar.getAttribute("data-percent")) || 0));
      bar.style.width = percent + "%";
    });
  }

  if (window.htmx) htmx.onLoad(fillBars);
  else document.addEventListener("DOMContentLoaded", function () { fillBars(document); });

  document.addEventListener("change", function (event) {
    var field = event.target.closest("[data-submit-on-change]");
    if (field && field.form) field.form.requestSubmit();
  });

  // Polled cards (hx-trigger="every 5s" with data-poll: figures that live in Redis, with nothing to push)
  // ask nothing while the tab is hidden; htmx keeps its timer, so they resume when it shows again. The
  // config forbids hx-trigger's [filter] expressions (allowEval false): this is the filter.
  document.addEventListener("htmx:beforeRequest", function (event) {
    var elt = event.detail && event.detail.elt;
    if (document.hidden && elt && elt.hasAttribute && elt.hasAttribute("data-poll")) event.preventDefault();
  });
})();

// Selections in a list: row checkboxes <input type="checkbox" name="N">, a header box
// <input data-select-all="N"> that ticks every one on the page, buttons [data-needs-selection="N"]
// that wait for a tick, and [data-selection-count="N"] that says how many are ticked. A live push
// replaces rows whole, so the ticks are kept by value and put back after every message.
(function () {
  "use strict";

  var ticked = {}; // name -> {value: true}

  function names() {
    var found = {};
    document.querySelectorAll("[data-select-all], [data-needs-selection]").forEach(function (el) {
      found[el.getAttribute("data-select-all") || el.getAttribute("data-needs-selection")] = true;
    });
    return Object.keys(found);
  }

  function boxes(name) {
    return document.querySelectorAll('input[type="checkbox"][name="' + name + '"]');
  }

  function show(name) {
    var all = boxes(name), count = 0;
    var chosen = ticked[name] || (ticked[name] = {});
    all.forEach(function (box) {
      box.checked = !!chosen[box.value];
      var row = box.closest("tr");
      if (row) row.classList.toggle("is-selected", box.checked);
      if (box.checked) count += 1;
    });
    document.querySelectorAll('[data-needs-selection="' + name + '"]').forEach(function (button) {
      button.disabled = count === 0;
      button.title = count === 0 ? "Tick the machines to act on first" : "";
    });
    document.querySelectorAll('[data-selection-count="' + name + '"]').forEach(function (label) {
      label.hidden = count === 0;
      label.textContent = count + " selected";
    });
    document.querySelectorAll('[data-select-all="' + name + '"]').forEach(function (head) {
      head.checked = count > 0 && count === all.length;
      head.indeterminate = count > 0 && count < all.length;
    });
  }

  function showAll() { names().forEach(show); }

  document.addEventListener("change", function (event) {
    var box = event.target;
    if (!box.matches || !box.matches('input[type="checkbox"]')) return;
    var head = box.getAttribute("data-select-all");
    var name = head || box.name;
    if (names().indexOf(name) < 0) return;
    var chosen = ticked[name] || (ticked[name] = {});
    if (head) {
      boxes(name).forEach(function (one) { if (box.checked) chosen[one.value] = true; else delete chosen[one.value]; });
    } else if (box.checked) {
      chosen[box.value] = true;
    } else {
      delete chosen[box.value];
    }
    show(name);
  });

  document.addEventListener("DOMContentLoaded", function () {
    // A page shown again from the browser's history keeps its ticks: start from them.
    names().forEach(function (name) {
      var chosen = ticked[name] || (ticked[name] = {});
      boxes(name).forEach(function (box) { if (box.checked) chosen[box.value] = true; });
      show(name);
    });
  });
  document.addEventListener("htmx:wsAfterMessage", showAll);
})();
