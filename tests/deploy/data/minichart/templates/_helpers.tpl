{{- define "mini.label" -}}
{{ .Chart.Name }}-{{ .Release.Name }}
{{- end -}}
