// Draws every figure the page embeds as JSON (no inline script: the Content-Security-Policy forbids it).
"use strict";
document.querySelectorAll("[data-figure]").forEach(function (div) {
  var figure = JSON.parse(document.getElementById(div.dataset.figure).textContent);
  Plotly.newPlot(div, figure.data, figure.layout, {displaylogo: false, displayModeBar: false, responsive: true}).then(function () {
    div.dataset.drawn = "true";
  });
});
